"""What holds a node's GPUs besides the panel's own engines (read on the node itself)."""
import psutil
from django.conf import settings

from deployments.host import gpu, listeners, ownership, supervisors
from deployments.models import Deployment, DeploymentRank, Node

__all__ = ["foreign_holders", "node_foreign_record", "node_listeners_record", "panel_markers", "stop_supervised"]


def panel_markers(node_id: int, spare=()) -> tuple[dict, set, dict]:
    """(marker -> (recorded PID, create time), systemd units, marker -> deployment id) of what the panel
    runs on the node: its active deployments and ranks, and the deployments in `spare` (the one being
    redeployed, those ticked under "Also stop") whatever their status. The third map also names every
    other deployment of the node that still has a marker, so a stray engine of a stopped one is named."""
    spare = set(spare)
    ours: dict[str, tuple] = {}
    units: set[str] = set()
    known: dict[str, int] = {}
    rows = Deployment.objects.filter(node_id=node_id).exclude(marker="").values_list(
        "pk", "marker", "status", "pid", "pid_create_time", "systemd_unit")
    for pk, marker, status, pid, born, unit in rows:
        known[marker] = pk
        if status in Deployment.ACTIVE or pk in spare:
            ours[marker] = (pid, born)
            if unit:
                units.add(unit)
    for pk, marker, status, pid, born in DeploymentRank.objects.filter(node_id=node_id).exclude(marker="").values_list(
            "deployment_id", "marker", "deployment__status", "pid", "pid_create_time"):
        known[marker] = pk
        if status in Deployment.ACTIVE or pk in spare:
            ours[marker] = (pid, born)
    return ours, units, known


def foreign_holders(node_id: int, gpu_indices: list[int] | None, spare=()) -> list[dict]:
    """Processes on these GPUs (None: on any GPU; on a node without GPUs: vLLM engines anywhere on
    the host) that no active deployment of this node (nor one in `spare`) started, by descent: a
    process is the panel's when it or an ancestor carries a deployment's marker. Each: PID, user,
    command, GPU memory (in all and per GPU), the GPUs it uses, whether it is a display server (never stopped), and the
    deployment whose stopped engine it is ("deployment", None for a stranger's)."""
    holders: dict[int, dict] = {}
    drawing: set[int] = set()  # listed as graphics processes only: display servers, whatever their name
    try:
        held = gpu.processes_on(gpu_indices) if gpu_indices else (
            {s.index: s.processes or [] for s in gpu.sample()} if gpu_indices is None else None)
    except gpu.NvmlUnavailable:
        held = None
    if held is None or (gpu_indices is None and not held):
        if not settings.CPU_HOST_EXCLUSIVE:
            return []
        holders = {pid: {"memory": 0, "gpus": [], "gpu_memory": {}} for pid in ownership.engine_processes()}
    else:
        for index, procs in held.items():
            for p in procs:
                entry = holders.setdefault(p.pid, {"memory": 0, "gpus": [], "gpu_memory": {}})
                entry["memory"] += p.used_memory or 0
                entry["gpus"].append(index)
                entry["gpu_memory"][str(index)] = p.used_memory or 0  # what the fit counts as taken (display servers)
                if p.graphics:
                    drawing.add(p.pid)
    if not holders:
        return []
    ours, units, known = panel_markers(node_id, spare)
    others = {m: (None, None) for m in known if m not in ours}
    found = []
    for pid in sorted(holders):
        if ownership.owner(pid, ours, units):
            continue
        info = ownership.describe(pid)
        if info["name"] == "?":
            continue  # gone meanwhile
        stray = ownership.owner(pid, others) if others else None
        found.append({**info, **holders[pid], "display": ownership.is_display_server(info, graphics=pid in drawing),
                      "deployment": known.get(stray) if stray else None,
                      "supervisor": supervisors.as_dict(supervisors.of(pid))})
    return found


def stop_supervised(blocking: list[dict]) -> tuple[list[str], list[dict]]:
    """Stop the holders that run under a systemd unit or a container through that manager (a SIGTERM by PID would
    see them back a second later): (what was done, for the timeline; the holders left to stop by PID)."""
    by_supervisor: dict[supervisors.Supervisor, list[dict]] = {}
    bare = []
    for p in blocking:
        if p.get("supervisor"):
            by_supervisor.setdefault(supervisors.Supervisor(**p["supervisor"]), []).append(p)
        else:
            bare.append(p)
    done = []
    for sup, held in by_supervisor.items():
        how = supervisors.stop(sup, [p["pid"] for p in held])  # SupervisorError, SystemdError: the plan fails
        done.append(f"{', '.join(supervisors.holder_text(p) for p in held)}: {how}")
    return done, bare


def node_foreign_record(node_id: int, previous: list[dict] | None) -> list[dict]:
    """Store what holds the node's GPUs besides the panel (the deploy form and API refuse with it)."""
    found = foreign_holders(node_id, None)
    if found != previous:
        Node.objects.filter(pk=node_id).update(foreign_processes=found)
    return found


def listeners_of(node_id: int, described: dict) -> list[dict]:
    """Every listening TCP port of the host: {port, pid, user, command, deployment, engine} (deployment: the one whose
    engine it is, by its marker or unit; engine: a process the panel launched, whichever deployment; neither for any
    other program). `described` keeps what was read of each
    (port, PID) for the next call: a host's listeners rarely change, and reading a PID's owner walks its ancestry."""
    rows = Deployment.objects.filter(node_id=node_id).values_list("pk", "marker", "systemd_unit")
    markers = {m: (None, None) for _, m, _ in rows if m}
    by_marker = {m: pk for pk, m, _ in rows if m}
    by_unit = {u: pk for pk, _, u in rows if u}
    found, kept = [], {}
    for port, pids in sorted(listeners.host_listeners().items()):
        pid = min(pids) if pids else None
        key = (port, pid, tuple(sorted(by_marker)), tuple(sorted(by_unit)))
        if key not in described:
            info = ownership.describe(pid) if pid else {"pid": None, "user": "?", "command": "?"}
            if pid and info["user"] == "?" and _ended(pid):
                continue  # gone as it was read (an engine just stopped, its socket not yet closed): nobody holds it
            mark = ownership.owner(pid, markers, set(by_unit)) if pid else None
            described[key] = {"port": port, "pid": pid, "user": info["user"], "command": info["command"][:120],
                              "deployment": by_marker.get(mark) or by_unit.get(mark),
                              # an engine the panel launched, whichever deployment (one being stopped right now too)
                              "engine": bool(mark or (pid and ownership.marker_of(pid)))}
        kept[key] = described[key]
        found.append(described[key])
    described.clear()
    described.update(kept)
    return found


def _ended(pid: int) -> bool:
    """The process is gone, or has exited and waits to be reaped (a zombie holds no socket, and shows nothing)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # another user's, to an agent that is not root: someone holds the port
        return False


def node_listeners_record(node_id: int, previous: list[dict] | None, described: dict) -> list[dict]:
    """Store who listens on which port of the node (the deploy form and API refuse a port in use with it)."""
    found = listeners_of(node_id, described)
    if found != previous:
        Node.objects.filter(pk=node_id).update(listeners=found)
    return found
