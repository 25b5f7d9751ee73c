"""A model copy's download on its node (beneath both sides): run by the node's host task and by a
deploy plan whose model is not there yet (deployments/node/steps.py), and the Hugging Face token it uses.
The control plane's model services (services/repos.py) queue downloads, cancel and retry them."""
import logging
import time

from django.conf import settings
from django.db import DatabaseError, close_old_connections, transaction
from django.utils import timezone

from deployments import modelfit, nodelive, payloads, sealed
from deployments.host import disk, downloads, hub, store
from deployments.models import Deployment, ModelCopy, ModelRepo, Node, Secret

log = logging.getLogger(__name__)
__all__ = ["hf_token", "model_copy_download", "model_copy_progress", "node_refresh_disk"]
PROGRESS_EVERY_S = 0.5  # how often a running download writes its progress and checks for cancel


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
        downloads.download(info, dest, token=hf_token() or None, endpoint=settings.HF_ENDPOINT,
                           on_progress=on_progress, should_cancel=lambda: last["cancel"])
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


def model_copy_progress(copy: ModelCopy, p: downloads.Progress) -> bool:
    """Record a download's progress on its row and on the model's and node's pages; returns whether
    a cancel was asked meanwhile."""
    copy.bytes_done, copy.bytes_total, copy.rate = p.bytes_done, p.bytes_total, p.rate_bps
    started_by = {"deployment": copy.progress["deployment"]} if (copy.progress or {}).get("deployment") else {}
    copy.progress = {"files": {k: list(v) for k, v in p.files.items()}, "current_file": p.current_file,
                     "seconds_left": p.seconds_left, **started_by}
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
