"""Reads for pages and the API."""
import shlex

from django.conf import settings
from django.db.models import Prefetch, QuerySet

from deployments import engineapikey, history, secrets
from deployments.gateway import media
from deployments.host import osuser, ownership, processenv, serveargv, systemd
from deployments.host.processes import EngineError
from deployments.models import Deployment, DeploymentEvent, DeploymentRank, ModelCopy, ModelRepo, Node
from plumbing import longpoll


def node_list() -> QuerySet[Node]:
    active = Deployment.objects.filter(status__in=Deployment.ACTIVE).select_related("model")
    return Node.objects.prefetch_related("gpus", Prefetch("deployments", queryset=active, to_attr="active_deployments"))


def node_ranks(node: Node) -> QuerySet[DeploymentRank]:
    """The ranks this node runs for active multi-node deployments headed on other nodes."""
    return (DeploymentRank.objects.filter(node=node, deployment__status__in=Deployment.ACTIVE)
            .exclude(state__in=DeploymentRank.ENDED).select_related("deployment__node", "deployment__model"))


def deployment_nodes(d: Deployment) -> list[dict]:
    """Every node of a deployment, head first, with the memory its chosen GPUs use (the host's RAM on a
    node without GPUs) in that node's last telemetry sample; the page follows each node's feed after."""
    rows = [{"node": d.node, "rank": 0, "state": d.get_status_display(), "indices": d.gpu_indices}]
    rows += [{"node": r.node, "rank": r.rank, "state": r.get_state_display(), "indices": r.gpu_indices}
             for r in d.ranks.select_related("node")]
    latest = history.latest_many([row["node"].pk for row in rows])
    for row in rows:
        sample = latest[row["node"].pk] or {}
        seen = {g["index"]: g for g in sample.get("gpus", [])}
        row["gpus"] = [{"index": i, "memory_used": seen.get(i, {}).get("memory_used"),
                        "memory_total": seen.get(i, {}).get("memory_total")} for i in row["indices"]]
        ram_total, available = sample.get("ram_total"), sample.get("ram_available")
        row["ram_used"] = ram_total - available if ram_total and available is not None else None
        row["ram_total"] = ram_total
    return rows


def model_list() -> QuerySet[ModelRepo]:
    return ModelRepo.objects.prefetch_related(Prefetch("copies", queryset=ModelCopy.objects.select_related("node")))


# What a list of copies shows (the API's ModelCopySerializer): each copy's node by name, its model by id.
# Not the node's JSON columns (engine flags, doctor report) nor the model's (config, file list): reading and
# decoding them for every copy made a list of 80 copies cost 12 ms of CPU instead of 5.
COPY_LIST_FIELDS = ("id", "model", "node__name", "state", "path", "bytes_done", "bytes_total", "rate", "progress",
                    "error", "error_code", "last_used", "updated")


def copy_rows() -> QuerySet[ModelCopy]:
    return ModelCopy.objects.select_related("node").only(*COPY_LIST_FIELDS)


def model_rows() -> QuerySet[ModelRepo]:
    """Models as the API lists them: without config and files (the serializer leaves them out), with their copies."""
    return ModelRepo.objects.defer("config", "files").prefetch_related(Prefetch("copies", queryset=copy_rows()))


def deployment_list() -> QuerySet[Deployment]:
    return Deployment.objects.select_related("model", "node").prefetch_related("gpus")


def deployment_progress(deployment: Deployment) -> tuple[str, list]:
    """A token that changes whenever the status, load progress or any timeline step changes, and the steps."""
    row = Deployment.objects.values("status", "load_percent").get(pk=deployment.pk)
    events = list(deployment.events.all())
    token = f"{row['status']}:{row['load_percent']}:" + ",".join(f"{e.pk}{'e' if e.ended else ''}" for e in events)
    return token, events


def deployment_wait(deployment: Deployment, token: str, wait_s: float = 0.0) -> tuple[str, list]:
    """The progress token and steps, once the token differs from `token` or `wait_s` has passed (a long poll)."""
    import time

    started = time.monotonic()
    deadline = started + wait_s
    while True:
        current, events = deployment_progress(deployment)
        if current != token or time.monotonic() >= deadline:
            return current, events
        # Quick at first (a sleep, wake or swap ends within a second or two of the request: perf/swap.py), then
        # every half second for the long waits (a load), which is one query per waiter and poll; at once when the
        # server stops.
        if longpoll.pause(0.1 if time.monotonic() - started < 5 else 0.5):
            return current, events


def _engine_argv(d: Deployment) -> tuple[list[str], dict, dict]:
    """The head engine's argv, environment and secret environment as its node runs it (its key is
    VLLM_API_KEY in the secret part: named, its value never here); EngineError for a row stored before flag
    names were canonical."""
    copy = ModelCopy.objects.filter(model=d.model, node=d.node).first()
    argv = serveargv.build_argv(settings.VLLM_BIN, copy.path if copy and copy.path else f"/models/{d.model.repo_id}",
                                d.port, serveargv.API_HOST, d.engine_args, media.engine_args(d))
    own = processenv.deployment_env(d.env, d.gpu_indices)
    env, secret_env = secrets.split(own if d.master_port else {**own, **processenv.LOOPBACK_ONLY}, secrets.marked(d))
    argv, flag_env = systemd.secret_argv(argv)
    return argv, env, {**secret_env, **flag_env, engineapikey.ENV_VAR: ""}


def deployment_command(d: Deployment) -> str:
    """The engine's whole command line, its environment first, to copy into a shell; secret variables are
    named on a comment line above it (export them first), their values never shown."""
    try:
        argv, env, secret_env = _engine_argv(d)
    except EngineError as exc:
        return f"# No command: {exc}."
    line = secrets.redact_deployment(d, " ".join([*(shlex.quote(f"{k}={v}") for k, v in env.items()), shlex.join(argv)]))
    return (f"# export {' '.join(secret_env)} first (secret: never shown here)\n" if secret_env else "") + line


def deployment_unit(d: Deployment) -> tuple[str, str]:
    """The systemd unit that runs deployment `d`, to install by hand: its file name and its text, with
    secret values masked (they belong in the unit's EnvironmentFile). While `d` runs, the unit carries its marker, as
    the units the panel installs do: an engine started from it is the deployment's to the panel (adopted, stopped
    with it), never a stranger on its GPUs."""
    name = systemd.unit_name(d.name)
    try:
        argv, env, secret_env = _engine_argv(d)
    except EngineError as exc:  # a row stored before flag names were canonical (flagpolicy): redeploy it
        return name, f"# No unit: {exc}."
    if d.marker:
        env = {**env, ownership.MARKER_VAR: d.marker, ownership.ROLE_VAR: "engine"}
    text = systemd.render_unit(description=f"vLLM {d.name} ({d.model})", argv=argv, env=env,
                               log_path=d.log_path or f"/var/log/vllm-{d.name}.log", working_dir=argv[2],
                               run_as=osuser.from_facts(d.node.engine_user),  # as the node's agent would
                               secret_env_file=str(systemd.env_file_path(name)) if secret_env else None)
    return name, secrets.redact_deployment(d, text)  # a secret flag value (--api-key) is shown masked


def load_events(**lookup) -> QuerySet:
    """Finished loads kept for history: their data has per-phase `totals`, newest first."""
    return (DeploymentEvent.objects.filter(step="load", level=DeploymentEvent.Level.INFO, ended__isnull=False,
                                           data__has_key="totals", **lookup)
            .select_related("deployment__node").order_by("-started"))


def deployment_starts(d: Deployment, limit: int = 10) -> list[DeploymentEvent]:
    """Its last starts, newest first: kept loads (cold or warm) and wakes from sleep (data start "wake")."""
    wakes = d.events.filter(step="wake", level=DeploymentEvent.Level.INFO, ended__isnull=False, data__start="wake")
    return sorted([*load_events(deployment=d)[:limit], *wakes.order_by("-started")[:limit]],
                  key=lambda e: e.started, reverse=True)[:limit]


def deployment_startup(d: Deployment) -> dict:
    """The deployment's latest kept load: seconds per phase and whether it started cold or warm (and why), for
    environment snapshots."""
    event = load_events(deployment=d).first()
    if not event:
        return {}
    totals = event.data["totals"]
    return {"ready_s": round(sum(v for k, v in totals.items() if k != "smoke_test"), 1), "totals": totals,
            **({"start": event.data["start"], "warm_by": event.data.get("warm_by") or []} if event.data.get("start") else {})}
