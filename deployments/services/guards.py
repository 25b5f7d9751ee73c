"""What holds a node's GPUs besides the panel's own engines (read on the node itself)."""
from django.conf import settings

from deployments.host import gpu, ownership
from deployments.models import Deployment, DeploymentRank, Node

__all__ = ["foreign_holders", "node_foreign_record"]


def foreign_holders(node_id: int, gpu_indices: list[int] | None) -> list[dict]:
    """Processes on these GPUs (None: on any GPU; on a node without GPUs: vLLM engines anywhere on
    the host) that no active deployment of this node started: PID, user, command, GPU memory,
    the GPUs they use and whether they are a display server (never stopped)."""
    holders: dict[int, dict] = {}
    try:
        held = gpu.processes_on(gpu_indices) if gpu_indices else (
            {s.index: s.processes or [] for s in gpu.sample()} if gpu_indices is None else None)
    except gpu.NvmlUnavailable:
        held = None
    if held is None or (gpu_indices is None and not held):
        if not settings.CPU_HOST_EXCLUSIVE:
            return []
        holders = {pid: {"memory": 0, "gpus": []} for pid in ownership.engine_processes()}
    else:
        for index, procs in held.items():
            for p in procs:
                entry = holders.setdefault(p.pid, {"memory": 0, "gpus": []})
                entry["memory"] += p.used_memory or 0
                entry["gpus"].append(index)
    ours = set(Deployment.objects.filter(node_id=node_id, status__in=Deployment.ACTIVE).exclude(marker="")
               .values_list("marker", flat=True))
    ours |= set(DeploymentRank.objects.filter(node_id=node_id).exclude(marker="").values_list("marker", flat=True))
    found = []
    for pid in sorted(holders):
        if ownership.marker_of(pid) in ours:
            continue
        info = ownership.describe(pid)
        if info["name"] == "?":
            continue  # gone meanwhile
        found.append({**info, **holders[pid], "display": ownership.is_display_server(info)})
    return found


def node_foreign_record(node_id: int, previous: list[dict]) -> list[dict]:
    """Store what holds the node's GPUs besides the panel (the deploy form and API refuse with it)."""
    found = foreign_holders(node_id, None)
    if found != previous:
        Node.objects.filter(pk=node_id).update(foreign_processes=found)
    return found
