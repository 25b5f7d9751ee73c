"""Services for nodes: registration, heartbeats, telemetry, routing host work."""
import logging

from django.db import transaction
from django.utils import timezone

from deployments import history, nodelive, payloads
from deployments.models import Deployment, DeploymentRank, Gpu, Node
from deployments.timeline import deployment_event

log = logging.getLogger(__name__)
__all__ = ["AgentConflict", "node_register", "node_heartbeat", "node_engines", "node_sample_record", "node_minute_record"]


class AgentConflict(Exception):
    """Another agent heartbeats under this node name: two hosts would share one queue."""


@transaction.atomic
def node_register(*, name: str, address: str, agent_version: str, model_store: str, heartbeat_seconds: float,
                  gpus: list, nvml_error: str = "", agent_host: str = "", agent_pid: int | None = None,
                  engine_user: dict | None = None) -> Node:
    """Create or update a node and its GPU rows from what its agent found at start; refuse when
    another live agent heartbeats under the same name."""
    from deployments.host import ownership

    node, _ = Node.objects.select_for_update().get_or_create(name=name)
    other = (node.agent_host, node.agent_pid) != (agent_host, agent_pid)
    # The same host's previous agent may have been killed a moment ago: only a live one counts.
    previous_dead = node.agent_host == agent_host and not ownership.agent_alive(node.agent_pid)
    if node.online and node.agent_pid and other and not previous_dead:
        raise AgentConflict(f"node {name!r} already has a running agent (PID {node.agent_pid} on "
                            f"{node.agent_host or 'another host'}, last heartbeat {node.last_heartbeat:%H:%M:%S}); "
                            "give this host its own name (--name or NODE_NAME), or stop the other agent.")
    lost = (node.agent_pid, node.last_heartbeat) if other and previous_dead and node.agent_pid else None
    node.agent_host, node.agent_pid = agent_host, agent_pid
    node.address = address
    node.agent_version = agent_version
    node.model_store = model_store
    node.heartbeat_seconds = heartbeat_seconds
    node.nvml_error = nvml_error
    node.engine_user = engine_user or {}
    node.last_heartbeat = timezone.now()
    node.save()
    transaction.on_commit(lambda: nodelive.record(node.pk, node.last_heartbeat, node.disk_total, node.disk_free))
    seen = []
    for info in gpus:
        Gpu.objects.update_or_create(
            node=node, index=info.index,
            defaults={"uuid": info.uuid, "name": info.name, "memory_total": info.memory_total,
                      "compute_capability": info.compute_capability or ""},
        )
        seen.append(info.index)
    node.gpus.exclude(index__in=seen).filter(deployments__isnull=True).delete()
    if lost:
        _agent_back(node, *lost)
    return node


def _agent_back(node: Node, old_pid: int, last_heartbeat) -> None:
    """A new agent took over from one that ended without a word (killed, crashed): each deployment the node runs
    says on its timeline when the old one was last heard from and how long the node had no agent, so a slow step
    there is seen as the agent's outage, not the engine's."""
    now = timezone.now()
    gap = f", {(now - last_heartbeat).total_seconds():.0f} s later" if last_heartbeat else ""
    heard = f" after its last heartbeat at {last_heartbeat:%H:%M:%S}" if last_heartbeat else ""
    for d in Deployment.objects.filter(node=node, status__in=Deployment.ACTIVE):
        deployment_event(d, "agent", f"The node agent (PID {old_pid}) was lost{heard}; a new agent (PID "
                         f"{node.agent_pid}) took over at {now:%H:%M:%S}{gap}. The engine was not stopped.",
                         level="warning")


def node_heartbeat(node_id: int, *, disk_total: int | None = None, disk_free: int | None = None,
                   ram_total: int | None = None, cpu_count: int | None = None) -> None:
    """Record that a node's agent is alive, with its model store's disk figures, RAM and cores."""
    fields = {"last_heartbeat": timezone.now()}
    if disk_total is not None:
        fields.update(disk_total=disk_total, disk_free=disk_free)
    if ram_total is not None:
        fields.update(ram_total=ram_total, cpu_count=cpu_count or 0)
    if Node.objects.filter(pk=node_id).update(**fields):  # then in Redis, for the node list (deployments/nodelive.py)
        transaction.on_commit(lambda: nodelive.record(node_id, fields["last_heartbeat"], disk_total, disk_free))


def node_engines(node_id: int) -> dict[int, dict]:
    """Active deployments of a node by process group (and PID), the ranks it runs for multi-node
    deployments headed elsewhere too: what a GPU process belongs to."""
    held = [(d.pid, d.pgid, {"id": d.pk, "name": d.name})
            for d in Deployment.objects.filter(node_id=node_id, status__in=Deployment.ACTIVE).exclude(pid=None)]
    held += [(r.pid, r.pgid, {"id": r.deployment_id, "name": f"{r.deployment.name} (rank {r.rank})"})
             for r in DeploymentRank.objects.filter(node_id=node_id, deployment__status__in=Deployment.ACTIVE)
             .exclude(pid=None).select_related("deployment")]
    owners = {}
    for pid, pgid, owner in held:
        owners[pid] = owner
        if pgid:
            owners[pgid] = owner
    return owners


def node_sample_record(node_id: int, sample: dict, engines: dict[int, dict], sample_seconds: float = 1.0) -> None:
    """Label GPU processes with their deployment, keep the sample in history, push it to browsers."""
    for g in sample["gpus"]:
        for proc in g.get("processes") or []:
            proc["deployment"] = engines.get(proc.get("pgid")) or engines.get(proc["pid"])
    history.push(node_id, sample, sample_seconds)
    payloads.send_node_sample(node_id, sample)


def node_minute_record(node_id: int, aggregate: dict) -> None:
    """Store one minute of a node's telemetry (bounded retention)."""
    history.record_minute(node_id, aggregate)
