"""What a node agent does when it starts: adopt engines still running, fail the dead ones, finish
interrupted stops, and record which vLLM this node runs."""
from django.conf import settings

from deployments.host import engine, enginecli, systemd
from deployments.models import Deployment, Node
from deployments.services.deploys import deployment_event
from deployments.services.nodes import node_enqueue
from deployments.services.ranks import ranks_reconcile
from deployments.services.steps import adopt_marked, engine_running, fail
from deployments.services.watch import expire_queued

S = Deployment.Status


def deployments_reconcile(node) -> dict:
    """On agent start: adopt engines still running, fail the dead ones, finish interrupted stops."""
    report = {"adopted": [], "failed": [], "following": []}
    expire_queued(node.pk)
    # A plan the killed agent had taken from the queue but not started stays unacked in the broker
    # until the visibility timeout: send it again (a duplicate finds the row moved on and returns).
    for d in Deployment.objects.filter(node=node, status=S.QUEUED):
        node_enqueue(node, "deployments.deployment_run", d.pk)
    for d in Deployment.objects.filter(node=node, status__in=Deployment.ACTIVE - {S.QUEUED}):
        running = engine_running(d) or (not d.pid and d.status in (S.STARTING, S.LOADING) and adopt_marked(d))
        if d.status == S.STOPPING:
            node_enqueue(node, "deployments.deployment_halt", d.pk)
        elif running and d.status == S.READY:
            report["adopted"].append(d.name)
            deployment_event(d, "adopted", f"The agent restarted and adopted the running engine (PID {d.pid}).")
        elif running and d.status in (S.STARTING, S.LOADING):
            report["following"].append(d.name)
            node_enqueue(node, "deployments.deployment_follow", d.pk)
        else:
            report["failed"].append(d.name)
            fail(d, "The node agent restarted and the engine is not running (or the plan was interrupted); redeploy it.")
    ranked = ranks_reconcile(node)  # issue 17: this node's worker ranks: adopted, or their group failed
    report["adopted"] += ranked["adopted"]
    report["failed"] += ranked["failed"]
    return report


def node_engine_report(node_id: int) -> None:
    """Record which vLLM this node runs and the flags it accepts (used to validate deploy forms)."""
    try:
        flags = sorted(enginecli.engine_flags(settings.VLLM_BIN))
        Node.objects.filter(pk=node_id).update(engine_flags=flags, engine_error="", systemd=systemd.available(),
                                               engine_version=enginecli.engine_version(settings.VLLM_BIN))
    except engine.EngineError as exc:
        Node.objects.filter(pk=node_id).update(engine_flags=[], engine_error=str(exc)[:500], systemd=systemd.available())
