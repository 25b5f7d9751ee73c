"""Services for models: add, inspect, fit, download with resume, cancel, retry, delete."""
import logging
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from deployments import claims, modelconfig, modelfit, payloads
from deployments.host import compilecache, hub, osuser, store
from deployments.modelcopies import hf_token, node_refresh_disk
from deployments.models import Deployment, ModelCopy, ModelRepo, Node, Secret
from deployments.dispatch import node_enqueue
from plumbing.errors import ServiceError
from plumbing.queue import enqueue

log = logging.getLogger(__name__)
__all__ = [
    "DiskShort", "model_disk_check", "model_add", "model_remove", "model_add_local", "model_inspect", "model_inspect_local",
    "model_download", "model_copy_cancel", "model_copy_retry", "model_copy_delete",
    "model_copy_remove", "model_copies_resume", "model_copies_stalled_resume", "hf_token_set",
    "model_download_cancel_for",
]
# A copy queued or downloading whose row has not moved for this long lost its task or its worker
# (Redis restarted empty, the database went away mid-download): the agent queues it again.
STALLED_S = 60.0


@dataclass
class DiskShort(ServiceError):
    """Not enough free space: the figures, and the copies that could be deleted to make room."""

    needed: int
    free: int
    candidates: list

    def __post_init__(self):
        super().__init__(
            f"Not enough disk space on the node: needs {modelfit.human_bytes(self.needed)}, "
            f"has {modelfit.human_bytes(self.free)} free. Free disk space first.",
            field="node", code="disk_full")


def hf_token_set(value: str) -> None:
    """Store encrypted (or clear, when empty) the Hugging Face token."""
    if value:
        Secret.put(Secret.HF_TOKEN, value.strip())
    else:
        Secret.objects.filter(name=Secret.HF_TOKEN).delete()


# --- adding and inspecting ------------------------------------------------------------------

def model_add(repo_id: str, revision: str = "main") -> ModelRepo:
    """Add a Hub repo (or find it) and fetch its files and config on the control worker. A repo or revision
    the hub does not know is refused before any row exists, with the hub's answer; a hub that
    cannot be asked now leaves it to the inspection, which retries."""
    revision = revision or "main"
    if not ModelRepo.objects.filter(repo_id=repo_id, revision=revision).exists():
        try:
            hub.repo_check(repo_id, revision, token=hf_token() or None, endpoint=settings.HF_ENDPOINT)
        except hub.HubError as exc:
            if exc.permanent:
                raise ServiceError(exc.message, field="revision" if exc.code == "revision_not_found" else "repo_id",
                                   code=exc.code) from exc
    model, _ = ModelRepo.objects.get_or_create(repo_id=repo_id, revision=revision)
    enqueue("deployments.model_inspect", args=[model.pk])
    return model


def model_remove(model: ModelRepo) -> None:
    """Forget a model the panel holds no copy or deployment of (a repo added by mistake, one the hub
    stopped knowing): refused, saying what to remove first, otherwise."""
    with transaction.atomic():
        model = ModelRepo.objects.select_for_update().get(pk=model.pk)
        if names := list(model.deployments.values_list("name", flat=True)[:3]):
            raise ServiceError(f"{model} has deployments ({', '.join(names)}): delete them first.", code="in_use")
        if nodes := list(model.copies.values_list("node__name", flat=True)[:3]):
            raise ServiceError(f"{model} has copies on {', '.join(nodes)}: delete them first.", code="in_use")
        model.delete()


def model_add_local(node: Node, path: str) -> ModelRepo:
    """Add a model folder already on a node; that node's agent reads it."""
    repo_id = "local/" + (Path(path).name or "model")
    model, _ = ModelRepo.objects.get_or_create(repo_id=repo_id, revision=f"{node.name}:{path}"[:200],
                                               defaults={"local_path": path})
    node_enqueue(node, "deployments.model_inspect_local", model.pk, node.pk)
    return model


def _apply_spec(model: ModelRepo, config: dict | None, files: list[tuple[str, int]]) -> None:
    model.config = config or {}
    if not config:
        return
    try:
        spec = modelconfig.parse_config(config, files)
    except (ValueError, TypeError, KeyError) as exc:
        # Files are known, the shape is not: say so instead of "Reading…" forever; no fit check.
        model.config = {}
        model.inspect_error = f"config.json cannot be read, so the GPU fit is unknown: {exc}"
        return
    for field in ("architecture", "model_type", "num_layers", "hidden_size", "num_attention_heads", "head_dim",
                  "kv_lora_rank", "qk_rope_head_dim", "experts_per_token", "quant_group_size", "quant_bits",
                  "num_parameters", "active_parameters", "context_length"):
        setattr(model, field, getattr(spec, field))
    model.num_kv_heads = spec.num_kv_heads
    model.attention = spec.attention or ""
    model.num_experts = spec.num_experts or None
    model.num_shared_experts = spec.num_shared_experts or None
    model.quant_method = spec.quant_method or ""
    model.quant_details = spec.quant_details or {}
    model.dtype = spec.dtype or ""


def model_inspect(model_id: int) -> ModelRepo:
    """Fetch a repo's commit, files with sizes and hashes, and config.json from the Hub."""
    model = ModelRepo.objects.get(pk=model_id)
    try:
        info = hub.repo_info(model.repo_id, model.revision, token=hf_token() or None, endpoint=settings.HF_ENDPOINT)
    except hub.HubError as exc:
        model.inspect_error = exc.message
        model.save(update_fields=["inspect_error"])
        payloads.send_model_inspect_failed(model.pk, exc.message, exc.code)
        if not exc.permanent:
            raise
        return model
    model.commit = info.commit
    model.files = [{"path": f.path, "size": f.size, "sha256": f.sha256, "blob_id": f.blob_id} for f in info.files]
    model.total_size = info.total_size
    model.inspect_error = ""
    model.inspected = timezone.now()
    _apply_spec(model, info.config, [(f.path, f.size) for f in info.files])
    model.save()
    payloads.send_model_inspected(model.pk)
    return model


def model_inspect_local(model_id: int, node_id: int) -> ModelRepo:
    """On the node: read a local model folder and record it as a ready copy there."""
    model = ModelRepo.objects.get(pk=model_id)
    node = Node.objects.get(pk=node_id)
    try:
        local = store.inspect_local(model.local_path, [node.model_store, *settings.LOCAL_MODEL_ROOTS],
                                    run_as=osuser.current())
    except (store.StoreError, osuser.EngineUserError) as exc:
        model.inspect_error = str(exc)
        model.save(update_fields=["inspect_error"])
        return model
    model.files = [{"path": p, "size": s, "sha256": None, "blob_id": None} for p, s in local.files]
    model.total_size = local.total_size
    model.inspect_error = ""
    model.inspected = timezone.now()
    _apply_spec(model, local.config, local.files)
    model.save()
    ModelCopy.objects.update_or_create(model=model, node=node, defaults={
        "state": ModelCopy.State.READY, "path": local.path, "bytes_done": local.total_size, "bytes_total": local.total_size})
    payloads.send_model_inspected(model.pk)
    return model


def model_disk_check(model: ModelRepo, nodes) -> list[dict]:
    """Per node: what a download still needs against the disk free there (shown before Download)."""
    done = dict(ModelCopy.objects.filter(model=model).values_list("node_id", "bytes_done"))
    rows = []
    for node in nodes:
        needed = max(model.total_size - done.get(node.pk, 0), 0)
        rows.append({"node": node, "needed": needed, "free": node.disk_free, "known": bool(node.disk_total),
                     "fits": not node.disk_total or needed <= node.disk_free})
    return rows


# --- downloads ------------------------------------------------------------------------------

def _deletable(node: Node, exclude: ModelCopy | None = None) -> list[dict]:
    """Other copies on the node, biggest first, and whether a running deployment holds each."""
    here = ModelCopy.objects.filter(node=node).values("model")
    busy = set(claims.model_users(node.pk, here).values_list("model_id", flat=True))  # heads and worker ranks
    copies = ModelCopy.objects.filter(node=node).exclude(state=ModelCopy.State.DELETING).select_related("model")
    if exclude:
        copies = copies.exclude(pk=exclude.pk)
    rows = [{"id": c.pk, "model": str(c.model), "size": c.bytes_done, "last_used": c.last_used,
             "in_use": c.model_id in busy} for c in copies]
    return sorted(rows, key=lambda r: -r["size"])


@transaction.atomic
def model_download(model: ModelRepo, node: Node) -> ModelCopy:
    """Queue a download of the model to the node, after checking the node has room for it."""
    if model.local_path:
        raise ServiceError("This model is a local folder; it cannot be downloaded.", field="model")
    if not model.inspected or not model.files:
        raise ServiceError(model.inspect_error or "The model has not been inspected yet; try again in a moment.",
                           field="model", code="not_inspected")
    copy, created = ModelCopy.objects.select_for_update().get_or_create(model=model, node=node)
    if not created and copy.state == ModelCopy.State.READY:
        raise ServiceError(f"{model} is already on {node}.", field="node", code="exists")
    if not created and copy.state not in (ModelCopy.State.FAILED, ModelCopy.State.CANCELLED):
        raise ServiceError(f"{model} is already {copy.get_state_display().lower()} on {node}.", field="node", code="busy")
    needed = max(model.total_size - copy.bytes_done, 0)
    if node.disk_total and needed > node.disk_free:
        raise DiskShort(needed=needed, free=node.disk_free, candidates=_deletable(node, exclude=copy))
    copy.transition(ModelCopy.State.QUEUED, bytes_total=model.total_size, error="", error_code="",
                    cancel_requested=False, progress={k: v for k, v in copy.progress.items() if k != "deployment"})
    copy.save()
    node_enqueue(node, "deployments.model_copy_download", copy.pk)
    payloads.send_copy(copy)
    return copy


def model_copy_cancel(copy: ModelCopy) -> ModelCopy:
    """Stop a download; what was fetched stays for a later retry."""
    with transaction.atomic():
        copy = ModelCopy.objects.select_for_update().get(pk=copy.pk)
        if copy.state not in ModelCopy.DOWNLOADABLE:
            raise ServiceError(f"Nothing to cancel: the copy is {copy.get_state_display().lower()}.", code="not_running")
        copy.cancel_requested = True
        if copy.state == ModelCopy.State.QUEUED and copy.bytes_done == 0:
            copy.transition(ModelCopy.State.CANCELLED)
        copy.save()
    payloads.send_copy(copy)
    return copy


def model_download_cancel_for(d: Deployment) -> list[str]:
    """Cancel the downloads `d`'s plan started that still run (a stop or delete while it prepares);
    a download a user started, which the plan only waits for, goes on. One line per copy, for the timeline."""
    said = []
    for copy in ModelCopy.objects.filter(model=d.model_id, state__in=ModelCopy.DOWNLOADABLE,
                                         progress__deployment=d.pk).select_related("node", "model"):
        try:
            copy = model_copy_cancel(copy)
        except ServiceError:
            continue  # it finished or failed meanwhile
        kept = f" ({modelfit.human_bytes(copy.bytes_done)} kept for a retry)" if copy.bytes_done else ""
        said.append(f"Cancelled the download of {copy.model} to {copy.node} it started{kept}.")
    return said


def model_copy_retry(copy: ModelCopy) -> ModelCopy:
    """Queue a failed or cancelled download again; it resumes from what is on disk."""
    if copy.state not in (ModelCopy.State.FAILED, ModelCopy.State.CANCELLED):
        raise ServiceError(f"Only a failed or cancelled download can be retried (it is {copy.state}).", code="not_failed")
    return model_download(copy.model, copy.node)


def model_copy_delete(copy: ModelCopy) -> ModelCopy:
    """Delete a copy's files on its node; refused while a deployment uses the model there."""
    with transaction.atomic():
        # The node's row lock is the one deploys take: a delete and a deploy racing are decided one
        # after the other, and exactly one wins (a deploy refuses a copy being deleted).
        claims.lock_node(copy.node_id)
        copy = ModelCopy.objects.select_for_update().select_related("node", "model").get(pk=copy.pk)
        users = _copy_users(copy)
        if users.exists():
            names = ", ".join(users.values_list("name", flat=True))
            raise ServiceError(f"{copy.model} is in use on {copy.node} by {names}; stop it first.", code="in_use")
        if copy.state == ModelCopy.State.DOWNLOADING:
            raise ServiceError("Cancel the download first.", code="busy")
        copy.transition(ModelCopy.State.DELETING)
        copy.save()
        node_enqueue(copy.node, "deployments.model_copy_remove", copy.pk)
    payloads.send_copy(copy)
    return copy


def _copy_users(copy: ModelCopy):
    """Active deployments that use the copy's folder on its node (by model, or by the same path), with their
    head there or a worker rank there (a multi-node deployment's rank serves from its own node's copy)."""
    same_folder = ModelCopy.objects.filter(node=copy.node_id, path=copy.path).values("model") if copy.path else []
    return claims.model_users(copy.node_id, [copy.model_id]) | claims.model_users(copy.node_id, same_folder)


def model_copy_remove(copy_id: int) -> int:
    """On the node: remove the copy's folder and its compile caches from the model store, then its row."""
    with transaction.atomic():
        claims.lock_copy_node(copy_id)
        copy = ModelCopy.objects.select_related("node", "model").filter(pk=copy_id).first()
        if copy is None or copy.state != ModelCopy.State.DELETING:
            return 0  # a duplicate message, or the copy came back meanwhile
        if _copy_users(copy).exists():  # never under a running engine, whatever let it start
            copy.transition(ModelCopy.State.READY)
            copy.save()
            payloads.send_copy(copy)
            return 0
    model_store = copy.node.model_store or settings.MODEL_STORE
    freed = 0
    if copy.path and not copy.model.local_path:  # a user's own folder is never deleted, only forgotten
        freed = store.remove(copy.path, model_store)
    if copy.path:  # its compiled graphs go with it, a local model's too (they are the panel's, in the store)
        try:
            freed += compilecache.remove_model(model_store, copy.path)
        except compilecache.CompileCacheError as exc:
            log.warning("copy %s: %s", copy.pk, exc)
    gone = payloads.CopyProgress.of(copy, state="deleted")
    copy.delete()
    node_refresh_disk(copy.node, model_store)
    payloads.send_copy_progress(gone)
    return freed


def _copy_task(copy: ModelCopy) -> str:
    """The host task that finishes what the copy's state says is under way."""
    return "deployments.model_copy_remove" if copy.state == ModelCopy.State.DELETING else "deployments.model_copy_download"


def model_copies_stalled_resume(node_id: int) -> list[int]:
    """Queue again the copies whose download or deletion stopped moving (a lost task, a worker hit
    by a database or Redis outage); a download still running answers "busy" and nothing changes."""
    from datetime import timedelta

    node = Node.objects.get(pk=node_id)
    stalled = ModelCopy.objects.filter(node=node, state__in=ModelCopy.ACTIVE,
                                       updated__lt=timezone.now() - timedelta(seconds=STALLED_S))
    resumed = []
    for copy in stalled:
        ModelCopy.objects.filter(pk=copy.pk).update(updated=timezone.now())  # once per stall, not every pass
        node_enqueue(node, _copy_task(copy), copy.pk)
        resumed.append(copy.pk)
    return resumed


def model_copies_resume(node: Node) -> list[int]:
    """On agent start: queue again the downloads and deletions that a stopped agent left unfinished."""
    resumed = []
    for copy in ModelCopy.objects.filter(node=node, state__in=ModelCopy.ACTIVE):
        node_enqueue(node, _copy_task(copy), copy.pk)
        resumed.append(copy.pk)
    return resumed
