"""A ready deployment whose engine (or any worker rank) died: failed, and restarted as a whole with backoff
when it asked for auto-restart. The crash watch (watch.py) and a worker node's lost rank (ranks.py) both end
here. A persisted (unit-backed) deployment is restarted by systemd, never here: see watch.units_watch."""
from pathlib import Path

from django.db import transaction

from deployments import claims, versions
from deployments.dispatch import send_plan
from deployments.host import exits, processlog
from deployments.models import Deployment
from deployments.node.lifecycle import TAIL_LINES
from deployments.node.steps import fail
from deployments.timeline import deployment_event

S = Deployment.Status


def deployment_crashed(d: Deployment, reason: str) -> None:
    """Fail a ready deployment whose engine (or any rank) died; auto-restart it as a whole with backoff."""
    if not Deployment.objects.filter(pk=d.pk, status__in=Deployment.UP).exists():
        return  # failed or restarted already: the head's engine and a worker rank were seen dying at once
    lost = d.ranks.select_related("node").filter(state="failed").first()
    if lost:  # the head often dies because a worker rank did; say which
        reason = f"rank {lost.rank} on node {lost.node.name} died ({lost.message}), then {reason}"
    d.log_tail = "\n".join(processlog.tail(Path(d.log_path), TAIL_LINES)) if d.log_path else d.log_tail
    last = exits.engine_lines(d.log_tail.splitlines())  # the engine's own: its /health and /metrics polls left out
    fail(d, f"Crashed: {reason}. " + ("Its last log lines: " + " | ".join(last) if last else "It logged nothing of its own."))
    if d.auto_restart and not d.systemd_unit:  # a unit-backed engine's restarts are systemd's (Restart=on-failure)
        delay = min(600, 10 * 2 ** d.restarts)
        if row := requeue(d, "auto_restart", countdown=delay, restarts=d.restarts + 1):
            deployment_event(d, "auto_restart", f"Restarting in {delay} s (restart {row.restarts}).")


def requeue(d: Deployment, step: str, countdown: float = 0, **fields) -> Deployment | None:
    """Queue a failed deployment's plan again, as a whole (every rank; every node's GPUs must be free), with `fields`
    changed on its row; None, said on the timeline under `step`, when it cannot be (moved on, or its GPUs taken)."""
    with transaction.atomic():
        claims.lock_node(d.node_id)
        row = Deployment.objects.select_for_update().get(pk=d.pk)
        if row.status != S.FAILED:
            return None  # moved on meanwhile (a stop, a redeploy)
        places = [(d.node, d.gpu_indices), *((r.node, r.gpu_indices) for r in d.ranks.select_related("node"))]
        clash = next(((n, c) for n, indices in places if (c := claims.deployment_holders(n, indices, exclude=d).first())), None)
        if clash:
            deployment_event(d, step, f"Not restarted: {clash[1].name} uses its GPUs on {clash[0]} now.")
            return None
        for name, value in fields.items():
            setattr(row, name, value)
        row.transition(S.QUEUED)
        row.save()
        versions.record(row, {"auto_restart": "auto-restart after a crash",
                              "advised_retry": "retry with the advised setting"}.get(step, step))
        send_plan(row, countdown=countdown)
    return row
