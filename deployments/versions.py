"""Deploy versions: every deploy and redeploy recorded as it was resolved (record, from services/deploys.py and the
node's advised retry), settled when its start ends (a receiver of every Deployment save: ready, failed or stopped),
compared (diff) and the known good one found, for a rollback that deploys it exactly.

Secrets are never stored twice: their values are masked here as everywhere (deployments/secrets.py), and a rollback
sends the mask back, which keeps the value the deployment holds now."""
from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver
from django.utils import timezone

from deployments import secrets
from deployments.models import Deployment, DeployVersion

S = Deployment.Status
O = DeployVersion.Outcome
SETTINGS = ("port", "auto_restart", "stall_seconds", "stop_foreign", "prewarm", "reuse_memory_profile", "sleep_mode",
            "start_asleep")


def resolved(d: Deployment) -> dict:
    """What a start of `d` is, as its row holds it now: enough to deploy it again exactly."""
    return {"engine_args": secrets.mask(d.engine_args), "env": secrets.mask(d.env, secrets.marked(d)),
            "secret_env": list(d.secret_env), "gpu_indices": d.gpu_indices,
            "workers": [{"node": r.node.name, "gpus": r.gpu_indices} for r in d.ranks.select_related("node")
                        .order_by("rank") if r.rank],
            "model": d.model.repo_id, "revision": d.model.revision, "commit": d.model.commit,
            "engine": d.node.engine_version or "", **{f: getattr(d, f) for f in SETTINGS}}


def record(d: Deployment, reason: str, user=None) -> DeployVersion:
    """The new version of a start just queued; the one before it, if its start never ended, is superseded."""
    with transaction.atomic():
        last = DeployVersion.objects.select_for_update().filter(deployment=d).first()
        if last and last.outcome == O.PENDING:
            _settle(last, O.STOPPED, "Superseded by a redeploy before it was ready.")
        return DeployVersion.objects.create(deployment=d, number=(last.number + 1) if last else 1, reason=reason,
                                            request=resolved(d), created_by=user if user and user.pk else None)


def _settle(v: DeployVersion, outcome: str, message: str) -> None:
    v.outcome, v.outcome_message, v.ended = outcome, message[:2000], timezone.now()
    if outcome == O.READY:
        v.ready_seconds = round((v.ended - v.created).total_seconds(), 1)
        v.steps = [[e.step, round(e.duration, 1)] for e in v.deployment.events.filter(started__gte=v.created)
                   .exclude(ended=None) if e.duration is not None]
    v.save()


@receiver(post_save, sender=Deployment, dispatch_uid="deploy-versions-settle")
def settle(sender, instance: Deployment, **kwargs) -> None:
    """A start that ended settles its version: ready (smoke-tested), failed (with the reason) or stopped. Only the
    save after a move to one of those (Deployment.entered) looks: every other save of a row costs no query."""
    if not instance.__dict__.pop("_start_ended", False):
        return
    outcome = {S.READY: O.READY, S.FAILED: O.FAILED, S.STOPPED: O.STOPPED}[instance.status]
    v = DeployVersion.objects.filter(deployment=instance, outcome=O.PENDING).first()
    if v is not None:
        _settle(v, outcome, instance.status_message or "")


def changes(v: DeployVersion) -> list[str] | None:
    """What changed from the version before `v` (None: `v` is the first one recorded)."""
    before = DeployVersion.objects.filter(deployment_id=v.deployment_id, number__lt=v.number).first()
    return None if before is None else diff(before.request, v.request)


def known_good(d: Deployment) -> DeployVersion | None:
    """The last version that reached ready (ready means smoke-tested: a failed smoke test fails the start)."""
    return DeployVersion.objects.filter(deployment=d, outcome=O.READY).first()


def _value(v) -> str:
    return "on" if v is True else "off" if v is False else str(v)


def diff(old: dict, new: dict) -> list[str]:
    """What changed from `old` to `new` (two versions' requests), one phrase each: "--max-num-seqs 64 → 16",
    "NCCL_PROTO added", "GPUs 0,1 → 0,1,2,3"."""
    said = []
    a, b = old.get("engine_args", {}), new.get("engine_args", {})
    for k in sorted(a.keys() | b.keys()):
        if k not in a:
            said.append(f"--{k} {_value(b[k])} added" if b[k] is not True else f"--{k} added")
        elif k not in b:
            said.append(f"--{k} removed")
        elif a[k] != b[k]:
            said.append(f"--{k} {_value(a[k])} → {_value(b[k])}")
    a, b = old.get("env", {}), new.get("env", {})
    for k in sorted(a.keys() | b.keys()):
        if k not in a:
            said.append(f"{k}={b[k]} added")
        elif k not in b:
            said.append(f"{k} removed")
        elif a[k] != b[k]:
            said.append(f"{k} {a[k]} → {b[k]}")
    for key, name in (("gpu_indices", "GPUs"), ("workers", "worker nodes"), ("commit", "model commit"),
                      ("revision", "model revision"), ("engine", "engine")):
        if old.get(key) != new.get(key):
            show = (lambda x: ",".join(map(str, x)) or "none") if key == "gpu_indices" else (lambda x: str(x or "—"))
            said.append(f"{name} {show(old.get(key))} → {show(new.get(key))}")
    for f in SETTINGS:
        if old.get(f) != new.get(f):
            said.append(f"{f.replace('_', ' ')} {_value(old.get(f))} → {_value(new.get(f))}")
    return said


def listed(d: Deployment) -> list[dict]:
    """The deployment's versions, newest first, each with what changed from the one before and whether it is the
    known good one, and the benchmark runs made while it served."""
    rows = list(DeployVersion.objects.filter(deployment=d).select_related("created_by"))
    good = next((v.pk for v in rows if v.outcome == O.READY), None)
    runs = list(d.benchmark_runs.values_list("pk", "created"))
    out = []
    for i, v in enumerate(rows):
        before = rows[i + 1] if i + 1 < len(rows) else None
        until = rows[i - 1].created if i else None
        out.append({"number": v.number, "reason": v.reason, "created": v.created, "ended": v.ended,
                    "by": v.created_by.get_username() if v.created_by else "", "outcome": v.outcome,
                    "outcome_message": v.outcome_message, "ready_seconds": v.ready_seconds, "steps": v.steps,
                    "known_good": v.pk == good, "request": v.request,
                    "changes": diff(before.request, v.request) if before else [],
                    "runs": [pk for pk, at in runs if at >= v.created and (until is None or at < until)]})
    return out
