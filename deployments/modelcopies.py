"""A model copy's download on its node (beneath both sides): run by the node's host task and by a
deploy plan whose model is not there yet (deployments/node/steps.py), and the Hugging Face token it uses.
The control plane's model services (services/repos.py) queue downloads, cancel and retry them."""
import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db import DatabaseError, close_old_connections, transaction
from django.utils import timezone

from deployments import modelfit, nodelive, payloads, sealed
from deployments.host import disk, downloads, hub, store
from deployments.models import Deployment, ModelCopy, ModelRepo, Node, Secret

log = logging.getLogger(__name__)
__all__ = ["hf_token", "model_copy_download", "model_copy_progress", "node_refresh_disk"]
PROGRESS_EVERY_S = 0.5  # how often a running download writes its progress and checks for cancel
RETRY_MAX_S = 60.0  # the longest backoff between two tries of a download (a server's Retry-After may ask longer)


def hf_token() -> str:
    """The panel's Hugging Face token (set in the UI, else HF_TOKEN); never logged or shown."""
    try:
        return Secret.get(Secret.HF_TOKEN) or settings.HF_TOKEN
    except sealed.Unreadable as exc:
        log.warning("the Hugging Face token stored in the panel cannot be read here: %s; using HF_TOKEN", exc)
        return settings.HF_TOKEN


def _repo_info(model: ModelRepo) -> hub.RepoInfo:
    files = [hub.RepoFile(f["path"], f["size"], f.get("sha256"), f.get("blob_id")) for f in model.files]
    return hub.RepoInfo(model.repo_id, model.revision, model.commit, files, model.config or None, model.total_size)


def model_copy_download(copy_id: int, deployment_id: int | None = None) -> ModelCopy:
    """On the node: fetch the copy's files (resuming partials), verify them, record progress live.
    `deployment_id`: the deployment whose plan started it, recorded on the copy; a stop or delete of that
    deployment cancels it, and so does the deployment no longer wanting it."""
    with transaction.atomic():
        copy = ModelCopy.objects.select_for_update().select_related("model", "node").get(pk=copy_id)
        if copy.state not in ModelCopy.DOWNLOADABLE:
            return copy  # cancelled, finished or deleted meanwhile
        if copy.cancel_requested:
            copy.transition(ModelCopy.State.CANCELLED)
            copy.save()
            payloads.send_copy(copy)
            return copy
        dest = store.model_dir(copy.node.model_store or settings.MODEL_STORE, copy.model.repo_id, copy.model.revision)
        progress = {**copy.progress, "deployment": deployment_id} if deployment_id else copy.progress
        copy.transition(ModelCopy.State.DOWNLOADING, path=str(dest), progress=progress)
        copy.save()
    info = _repo_info(copy.model)
    needed = downloads.bytes_needed(info, dest)
    free = disk.disk_usage(dest).free
    if needed > free:
        return _copy_fail(copy, f"Not enough disk space on {copy.node}: needs {modelfit.human_bytes(needed)}, "
                                f"has {modelfit.human_bytes(free)} free. Free disk space first.", "disk_full")
    last = {"at": 0.0, "cancel": False}

    def on_progress(p: downloads.Progress) -> None:
        now = time.monotonic()
        if now - last["at"] < PROGRESS_EVERY_S and p.bytes_done < p.bytes_total:
            return
        last["at"] = now
        last["cancel"] = model_copy_progress(copy, p) or (deployment_id is not None and not _still_wanted(deployment_id))

    try:
        _fetch(copy, info, dest, on_progress, lambda: last["cancel"], deployment_id)
    except DatabaseError:
        # The row stays "downloading"; it stops moving, and the agent resumes it once the
        # database answers again (model_copies_stalled_resume). The partial files stay.
        log.warning("download of copy %s interrupted by the database; it resumes when it is back", copy.pk)
        close_old_connections()
        return copy
    except downloads.DownloadCancelled:
        copy.transition(ModelCopy.State.CANCELLED)
        copy.save()
        payloads.send_copy(copy)
        return copy
    except hub.HubError as exc:
        if exc.code == "busy":  # a redelivered task while this copy's download runs elsewhere on the node
            return copy
        return _copy_fail(copy, exc.message, exc.code)
    copy.transition(ModelCopy.State.READY, bytes_done=info.total_size, bytes_total=info.total_size, rate=0.0,
                    error="", error_code="")
    copy.save()
    node_refresh_disk(copy.node, dest)
    payloads.send_copy(copy)
    return copy


def _fetch(copy: ModelCopy, info: hub.RepoInfo, dest, on_progress, should_cancel, deployment_id: int | None) -> None:
    """downloads.download, and again from the partial files after each transient error, waiting the server's
    Retry-After or a backoff; a permanent error, DOWNLOAD_RETRIES failures in a row without a new byte, or the same
    file arriving corrupt twice ends it with that error."""
    failures, retries, corrupt, before = 0, 0, set(), copy.bytes_done
    while True:
        try:
            return downloads.download(info, dest, token=hf_token() or None, endpoint=settings.HF_ENDPOINT,
                                      on_progress=on_progress, should_cancel=should_cancel)
        except hub.HubError as exc:
            if exc.permanent or exc.code == "busy":
                raise
            if exc.code == "corrupt" and exc.message in corrupt:
                raise hub.HubError(f"{exc.message.split(';')[0]}, twice: the server sends other bytes than it lists.",
                                   True, "corrupt") from exc
            if exc.code == "corrupt":
                corrupt.add(exc.message)
            failures = 1 if copy.bytes_done > before else failures + 1
            before, retries = copy.bytes_done, retries + 1
            if failures > settings.DOWNLOAD_RETRIES:
                raise hub.HubError(f"{exc.message} {failures} tries in a row brought no new byte; "
                                   "Retry resumes from what is kept.", True, exc.code) from exc
            delay = exc.retry_after or min(settings.DOWNLOAD_RETRY_FIRST_S * 2 ** (failures - 1), RETRY_MAX_S)
            log.warning("download of copy %s: %s; try %d in %.0f s", copy.pk, exc.message, retries + 1, delay)
            _retry_wait(copy, retries, exc.message, delay, deployment_id)


def _retry_wait(copy: ModelCopy, retries: int, reason: str, delay: float, deployment_id: int | None) -> None:
    """Show the wait on the copy (its next try, why, how many so far), then wait it out unless cancelled."""
    at = timezone.now() + timedelta(seconds=delay)
    copy.progress = {**copy.progress, "retries": retries, "retry": {"at": at.isoformat(), "reason": reason}}
    copy.rate = 0.0
    ModelCopy.objects.filter(pk=copy.pk).update(progress=copy.progress, rate=0.0, updated=timezone.now())
    payloads.send_copy(copy)
    deadline = time.monotonic() + delay
    while (left := deadline - time.monotonic()) > 0:
        if _cancelled(copy, deployment_id):
            raise downloads.DownloadCancelled(f"Download of {copy.model} cancelled; partial files are kept.")
        # Alive, for a deploy plan waiting on this copy from another worker (steps.model_ready's stall check).
        ModelCopy.objects.filter(pk=copy.pk).update(updated=timezone.now())
        time.sleep(min(1.0, left))


def _cancelled(copy: ModelCopy, deployment_id: int | None) -> bool:
    """A cancel asked on the copy, or the deployment that started it no longer wanting it."""
    return ModelCopy.objects.filter(pk=copy.pk, cancel_requested=True).exists() or (
        deployment_id is not None and not _still_wanted(deployment_id))


def model_copy_progress(copy: ModelCopy, p: downloads.Progress) -> bool:
    """Record a download's progress on its row and on the model's and node's pages; returns whether
    a cancel was asked meanwhile."""
    copy.bytes_done, copy.bytes_total, copy.rate = p.bytes_done, p.bytes_total, p.rate_bps
    kept = {k: copy.progress[k] for k in ("deployment", "retries") if (copy.progress or {}).get(k)}
    copy.progress = {"files": {k: list(v) for k, v in p.files.items()}, "current_file": p.current_file,
                     "seconds_left": p.seconds_left, **kept}
    ModelCopy.objects.filter(pk=copy.pk).update(bytes_done=p.bytes_done, bytes_total=p.bytes_total,
                                                rate=p.rate_bps, progress=copy.progress, updated=timezone.now())
    cancel = ModelCopy.objects.filter(pk=copy.pk, cancel_requested=True).exists()
    payloads.send_copy(copy)
    return cancel


def _copy_fail(copy: ModelCopy, message: str, code: str) -> ModelCopy:
    copy.transition(ModelCopy.State.FAILED, error=message, error_code=code, rate=0.0)
    copy.save()
    payloads.send_copy(copy)
    return copy


def node_refresh_disk(node: Node, path) -> None:
    usage = disk.disk_usage(path)
    Node.objects.filter(pk=node.pk).update(disk_total=usage.total, disk_free=usage.free)
    transaction.on_commit(lambda: nodelive.record(node.pk))  # not a heartbeat: the list reads the row


def _still_wanted(deployment_id: int) -> bool:
    """The deployment whose plan started a download still wants its model (not stopping, stopped or gone)."""
    return Deployment.objects.filter(pk=deployment_id, status__in=Deployment.ACTIVE - {Deployment.Status.STOPPING}).exists()
