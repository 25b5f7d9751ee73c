"""What a node agent does when it starts: adopt engines still running, fail the dead ones, finish
interrupted stops, and record which vLLM this node runs."""
import logging

from django.conf import settings

from deployments.dispatch import node_enqueue
from deployments.host import door, enginemodules, firewall, keepers, processes, serveargv
from deployments.models import Deployment, Node
from deployments.node import lifecycle, sleep, units
from deployments.node.ranks import ranks_reconcile
from deployments.node.steps import fail
from deployments.node.watch import expire_queued
from deployments.timeline import deployment_event

S = Deployment.Status
log = logging.getLogger(__name__)


def deployments_reconcile(node) -> dict:
    """On agent start: adopt engines still running, fail the dead ones, finish interrupted stops."""
    report = {"adopted": [], "failed": [], "following": []}
    kept: set[int] = set()  # the ports of engines that are (or will be again) this node's
    expire_queued(node.pk)
    # A plan the killed agent had taken from the queue but not started stays unacked in the broker
    # until the visibility timeout: send it again (a duplicate finds the row moved on and returns).
    for d in Deployment.objects.filter(node=node, status=S.QUEUED):
        node_enqueue(node, "deployments.deployment_run", d.pk)
    for d in Deployment.objects.select_related("node").filter(node=node, status__in=Deployment.ACTIVE - {S.QUEUED}):
        # A PID never recorded (the agent died right after the launch) is found by the marker; only the engine
        # itself is adopted, never a Ray head carrying the same marker while the cluster forms.
        running = lifecycle.running(d) or (not d.pid and d.status in (S.STARTING, S.LOADING) and lifecycle.adopt(d))
        if d.status != S.STOPPING and d.port:  # after a reboot the door's set is empty while units bring engines back
            kept.add(d.port)
            try:
                door.shut(d.port, node.name)
            except firewall.FirewallError as exc:
                log.warning("%s: port %s stays open to local users: %s", d, d.port, exc)
        if d.status == S.STOPPING:
            node_enqueue(node, "deployments.deployment_halt", d.pk)
        elif not running and d.systemd_unit and d.marker and d.status in (S.STARTING, S.LOADING, S.READY):
            report["failed" if units.unit_settle(d) == "failed" else "following"].append(d.name)
        elif running and d.status in Deployment.UP:
            report["adopted"].append(d.name)
            deployment_event(d, "adopted", f"The agent restarted and adopted the running engine (PID {d.pid}).")
            sleep.reconcile_sleep(d)  # a swap cut short: asleep or serving, as the engine says
        elif running and d.status in (S.STARTING, S.LOADING):
            report["following"].append(d.name)
            node_enqueue(node, "deployments.deployment_follow", d.pk)
        else:
            report["failed"].append(d.name)
            fail(d, "The node agent restarted and the engine is not running (or the plan was interrupted); redeploy it.")
    door.sweep(node.name, kept)  # ports of engines that ended while no agent watched
    ranked = ranks_reconcile(node)  # this node's worker ranks: adopted, waiting for their unit, or their group failed
    report["adopted"] += ranked["adopted"]
    report["failed"] += ranked["failed"]
    report["following"] += ranked["waiting"]
    return report


def node_engine_report(node_id: int) -> None:
    """Record which vLLM this node runs, the flags it accepts and the optional packages its Python has (used to
    validate deploy forms)."""
    try:
        flags = sorted(serveargv.engine_flags(settings.VLLM_BIN))
        Node.objects.filter(pk=node_id).update(engine_flags=flags, engine_error="", systemd=keepers.available(),
                                               engine_version=serveargv.engine_version(settings.VLLM_BIN),
                                               engine_modules=enginemodules.report(settings.VLLM_BIN))
    except processes.EngineError as exc:
        Node.objects.filter(pk=node_id).update(engine_flags=[], engine_error=str(exc)[:500], systemd=keepers.available())
