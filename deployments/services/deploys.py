"""Services for deployments, control-plane side: create, redeploy, restart, stop, persist.

Each one validates, writes the row and sends the work to the node's agent
(deployments/node/plan.py and watch.py run it there).
"""
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils.text import slugify

from deployments import (callit, deploydefaults, flagpolicy, flagvalues, layout, payloads, privileged, secrets,
                         versions, warmstart)
from deployments.host import ownership, supervisors
from deployments.models import Deployment, ModelCopy, ModelRepo, Node
from deployments.services import compatgate, fitgate, multinode, recipes, repos, sleepgate
from deployments.claims import deployment_holders, lock_node
from deployments.dispatch import node_enqueue, send_plan
from deployments.dispatch import ranks_stop as deployment_ranks_stop
from deployments.gateway import keys
from deployments.timeline import deployment_event
from plumbing.errors import ServiceError
from plumbing.roles import is_admin

__all__ = ["deployment_ranks_stop", "deployment_create", "deployment_free_port", "deployment_default_name", "deployment_redeploy", "deployment_stop", "deployment_persist", "deployment_holders",
           "deployment_event", "ForeignProcesses",
           "deployment_delete"]


def _check(*, model: ModelRepo, node: Node, gpu_indices: list[int], port: int, engine_args: dict,
           replace_ids: list[int], deployment: Deployment | None = None, stop_foreign: bool = False, nnodes: int = 1,
           env: dict | None = None, override_fit: bool = False, admin: bool = False, resolved=None,
           override_compat: bool = False, sleep_mode: bool = False, start_asleep: bool = False,
           was_sleep_mode: bool = False) -> list[tuple[str, object]]:
    """Refuse what cannot work before anything is stopped or started. Callers hold the node's
    row lock, so two claims on one node's GPUs are decided one after the other.

    Each check says its own reason, in the order a user can act on: what was typed (flag
    values, GPUs, the model), then the port, then what holds the node (the panel's own deployments
    loading, then processes the panel did not start) — a bad value is never reported as a busy host.
    A fit verdict and the compatibility gate (a recipe's minimum vLLM and GPU memory,
    combinations known to fail) belong after the port and before the holders. Returns the admin overrides
    to record on the timeline, as (step, override)."""
    if problems := flagvalues.problems(engine_args):
        raise ServiceError("; ".join(problems) + ".", field="engine_args")
    gpus = {g.index for g in node.gpus.all()}
    if set(gpu_indices) - gpus:
        raise ServiceError(f"{node} has no GPU {sorted(set(gpu_indices) - gpus)[0]}.", field="gpus")
    parallel = 1
    for name in flagpolicy.COUNT_FLAGS:  # canonical names: tensor_parallel_size cannot dodge this
        parallel *= flagpolicy.count(engine_args, name)
    if gpus and not gpu_indices:
        raise ServiceError("Choose the GPUs to serve on.", field="gpus")
    if gpus and nnodes == 1 and parallel > len(gpu_indices):  # over several nodes: multinode.check splits it
        raise ServiceError(f"TP × PP × DP = {parallel} needs {parallel} GPUs; {len(gpu_indices)} chosen.", field="tp")
    if ModelCopy.objects.filter(model=model, node=node, state=ModelCopy.State.DELETING).exists():
        raise ServiceError(f"{model} is being deleted on {node}; download it again after that.", field="model",
                           code="in_use")
    has_copy = ModelCopy.objects.filter(model=model, node=node, state=ModelCopy.State.READY).exists()
    if not has_copy and (model.local_path or not model.files):
        raise ServiceError(model.inspect_error or f"{model} is not on {node} and cannot be downloaded there yet.",
                           field="model", code="not_inspected")
    sleepgate.check_sleep_mode(node, nnodes, sleep_mode, start_asleep, admin=admin, was_on=was_sleep_mode)
    sharing = sleepgate.sharers(node, gpu_indices, sleep_mode, exclude=deployment)  # put to sleep, not stopped
    replaced = set(replace_ids) | set(deployment_holders(node, gpu_indices).values_list("pk", flat=True)) - sharing
    same_port = node.deployments.filter(status__in=Deployment.ACTIVE, port=port).exclude(pk__in=replaced)
    if deployment:
        same_port = same_port.exclude(pk=deployment.pk)
    if same_port.exists():
        raise ServiceError(f"Port {port} is used by {same_port.first().name} on {node}.", field="port", code="port_in_use")
    if port == (node.gateway_port or settings.GATEWAY_PORT):
        raise ServiceError(f"Port {port} is {node}'s gateway port: choose another port.", field="port", code="port_in_use")
    # The agent names the deployment a stray engine belongs to: the one redeployed and those
    # ticked under "Also stop" are stopped by the plan itself, never foreign.
    spare = {*replace_ids, *([deployment.pk] if deployment else [])}
    strangers = [p for p in node.foreign_processes if not p.get("display") and p.get("deployment") not in spare]
    # Any other program listening there, as the agent last saw the host (seconds ago). The panel's own engines are the
    # rows' to judge (above): a record seconds old may show one that has stopped since; the node checks again anyway.
    # A redeploy on its own port while its engine is up: that engine holds the port, so nothing there is a stranger's
    # (a socket caught as a process ended or began reads with no owner); the node checks the port after the stop.
    own_port = deployment is not None and deployment.port == port and deployment.status in Deployment.UP
    if not own_port and (listener := next((p for p in node.listeners if p["port"] == port and not p.get("engine")),
                                          None)):
        by = f" by PID {listener['pid']} ({listener['user']}: {ownership.short_command(listener['command'])})" if listener["pid"] else ""
        raise ServiceError(f"Port {port} is in use on {node}{by}: choose another port, or stop it.", field="port",
                           code="port_in_use")
    fit = fitgate.model_fit_gate(model, node, gpu_indices, engine_args, env or {}, nnodes=nnodes,
                                 override=override_fit, admin=admin, deployment=deployment)
    compat = compatgate.compat_gate(model, node, gpu_indices, engine_args, env or {}, resolved=resolved, nnodes=nnodes,
                                    gpu_bytes=sum(g.memory_total for g in node.gpus.all() if g.index in gpu_indices) * nnodes,
                                    override=override_compat, admin=admin, deployment=deployment)
    busy = [d for d in deployment_holders(node, gpu_indices, exclude=deployment) if d.status in Deployment.IN_FLIGHT]
    if busy:
        what = f"GPUs {', '.join(map(str, gpu_indices))} are" if gpu_indices else "The node is"  # a CPU node: the host
        raise ServiceError(f"{what} busy: {busy[0].name} is {busy[0].get_status_display().lower()}.", field="gpus",
                           code="gpus_busy")
    foreign = [p for p in strangers if not gpu_indices or set(p.get("gpus") or []) & set(gpu_indices)]
    if foreign and not stop_foreign:
        raise ForeignProcesses(processes=foreign, on_gpus=bool(gpus))
    return [(step, o) for step, o in (("fit_override", fit), ("compat_override", compat)) if o]


def _check_profile(reuse: bool, model: ModelRepo, node: Node, gpu_indices: list[int], engine_args: dict, env: dict) -> None:
    """With \"reuse the last memory profile\": a load of the same model, GPUs, settings and engine recorded one, or
    the deploy is refused saying what changed (the node checks again before its launch)."""
    if reuse:
        try:
            warmstart.reusable_profile(model, node, gpu_indices, engine_args, env)
        except warmstart.ProfileRefused as exc:
            raise ServiceError(str(exc), field="reuse_memory_profile", code="no_memory_profile") from exc


@dataclass
class ForeignProcesses(ServiceError):
    """Processes the panel did not start hold the chosen GPUs: the operator decides (409)."""

    processes: list
    on_gpus: bool = True  # False: a node without GPUs, whose whole host is one engine's claim

    def __post_init__(self):
        names = "; ".join(supervisors.holder_text(p, 60) for p in self.processes)
        held = ("Other processes hold the chosen GPUs" if self.on_gpus else
                "Other vLLM engines run on this node, which has no GPUs and runs one engine at a time")
        super().__init__(f"{held}: {names}. Stop them, or tick \"stop other processes on these GPUs\" "
                         "(API: stop_foreign, panelctl: --stop-foreign).", field="gpus", code="foreign_processes")


def deployment_free_port(node: Node) -> int:
    """The first engine port no active deployment on the node holds and no program listens on (as the agent last
    saw the host), never the node's gateway's (refused to an engine: _check) nor the panel's own (where the panel runs on the node, the launch finds it taken; elsewhere
    8000 is vLLM's own default, which a user may choose)."""
    taken = set(node.deployments.filter(status__in=Deployment.ACTIVE).values_list("port", flat=True))
    taken |= {settings.PANEL_PORT, node.gateway_port or settings.GATEWAY_PORT, *(p["port"] for p in node.listeners)}
    port = settings.ENGINE_PORT_FIRST
    while port in taken:
        port += 1
    return port


def deployment_default_name(model: ModelRepo, node: Node) -> str:
    return slugify(f"{model.repo_id.split('/')[-1]}-{node.name}")[:70] or "deployment"


def _unique_name(base: str) -> str:
    name, n = base, 1
    while Deployment.objects.filter(name=name).exists():
        n += 1
        name = f"{base}-{n}"
    return name


@transaction.atomic
def deployment_create(*, model: ModelRepo, node: Node, gpu_indices: list[int], port: int | None, engine_args: dict,
                      env: dict, name: str = "", replace_ids=(), secret_env=(), auto_restart: bool = False, stall_seconds: int = 600,
                      stop_foreign: bool = False, prewarm: bool = False, user=None, preset: str = "", replace_existing: bool = False,
                      workers=(), master_port: int | None = None, override_fit: bool = False,
                      reuse_memory_profile: bool = False,
                      recipe: recipes.Choice | None = None, override_compat: bool = False, sleep_mode: bool = False,
                      start_asleep: bool = False, retry_advised: bool = False) -> Deployment:
    """Create a deployment and queue its plan on the node: model, stop holders, wait for memory, launch, load.
    `retry_advised`: a start that fails for a memory cause with a certain fix starts once more with it.

    `port=None` takes a free one; `preset` ("auto": the node's) goes under the given flags and environment.
    A stopped or failed deployment of this model on this node under the default name is deployed again
    rather than a new `-2` row made per try; an existing name is redeployed only with `replace_existing`.
    `workers` (multinode.Worker: node and GPUs) spread it over more nodes, `node` being the head.
    `recipe`: the deploy starts from that recipe, variant and strategy on this node — with a preset
    key its form values go under the given flags (the API and panelctl), without one the flags are complete
    (the form, filled from it) — its GPUs by default, and the queued step says which recipe and what changed."""
    workers = multinode.lock_nodes(node, list(workers)) if workers else []  # every node's lock, in id order
    node = lock_node(node.pk)  # one deploy decision per node at a time
    engine_args, env = privileged.canonical(engine_args, env)  # one spelling for every check below and the argv
    # The form's defaults for the node under the caller's own (the CLI is the form), and the
    # repo id as the served name unless one is given, so the stored flags and the plan show what to call.
    use = recipes.recipe_use(recipe, node, gpu_indices, 1 + len(workers), callit.served_name(model)) if recipe else None
    gpu_indices = gpu_indices or (use.gpu_indices if use else [])
    engine_args, env = deploydefaults.with_defaults(node, model, engine_args, env, preset, base=use and use.defaults)
    if problem := secrets.check_marked(secret_env, env, engine_args):
        raise ServiceError(problem, field="secret_env")
    existing = Deployment.objects.filter(name=name or deployment_default_name(model, node)).first()
    ray = layout.executor(engine_args) == "ray"  # a Ray deployment has a Ray head port, on one node too
    reusable = existing and existing.model_id == model.pk and existing.node_id == node.pk and bool(workers or ray) == bool(
        existing.master_port) and (replace_existing or (not name and existing.status in Deployment.TERMINAL))
    if reusable:
        return deployment_redeploy(existing, gpu_indices=gpu_indices, port=port or existing.port, engine_args=engine_args,
                                   env=env, secret_env=list(secret_env), replace=list(replace_ids), auto_restart=auto_restart,
                                   stall_seconds=stall_seconds, stop_foreign=stop_foreign, prewarm=prewarm, user=user,
                                   override_fit=override_fit, override_compat=override_compat, recipe_use=use,
                                   reuse_memory_profile=reuse_memory_profile,
                                   sleep_mode=sleep_mode, start_asleep=start_asleep, retry_advised=retry_advised,
                                   **({"workers": workers} if workers else {}))
    if name and existing:
        raise ServiceError(f"A deployment named {name} exists already; redeploy it (panelctl deploy --replace, or "
                           "Restart on its page) or choose another name.", field="name", code="exists")
    port = port or deployment_free_port(node)
    overrides = _check(model=model, node=node, gpu_indices=gpu_indices, port=port, engine_args=engine_args,
                       replace_ids=list(replace_ids), stop_foreign=stop_foreign, nnodes=1 + len(workers), env=env,
                       override_fit=override_fit, admin=is_admin(user), resolved=use and use.resolved,
                       override_compat=override_compat, sleep_mode=sleep_mode, start_asleep=start_asleep)
    keys.names_check(user, [engine_args.get("served-model-name")], replace_ids, field="engine_args")
    multinode.check_executor(engine_args, 1 + len(workers))
    if workers:
        multinode.check(model=model, head=node, head_gpus=gpu_indices, workers=workers, engine_args=engine_args,
                        master_port=master_port)
    privileged.check(engine_args=engine_args, env=env, model_dir=privileged.model_dir(model, node), admin=is_admin(user))
    _check_profile(reuse_memory_profile, model, node, gpu_indices, engine_args, env)
    d = Deployment.objects.create(
        name=name or _unique_name(deployment_default_name(model, node)), model=model, node=node, port=port,
        engine_args=engine_args, env=env, secret_env=list(secret_env), replace=list(replace_ids), auto_restart=auto_restart,
        stall_seconds=stall_seconds, stop_foreign=stop_foreign, prewarm=prewarm,
        reuse_memory_profile=reuse_memory_profile, created_by=user, sleep_mode=sleep_mode,
        start_asleep=start_asleep, retry_advised=retry_advised)
    d.gpus.set(node.gpus.filter(index__in=gpu_indices))
    if workers or ray:  # Ray on one node too: the panel starts (and stops) its one-node cluster
        multinode.place(d, workers, master_port)
    versions.record(d, "deploy", user)
    said, said_data = _recipe_said(use, engine_args, env, model.repo_id, secret_env)
    if workers:
        deployment_event(d, "queued", f"Queued over {1 + len(workers)} nodes: head {node} (GPUs {gpu_indices or 'none, CPU'}, "
                         f"port {port}, {multinode.port_name(engine_args)} {d.master_port}); " + "; ".join(
                             f"rank {i} on {w.node} (GPUs {w.gpu_indices or 'none, CPU'})" for i, w in enumerate(workers, 1))
                         + "." + said, **said_data)
    else:
        deployment_event(d, "queued", f"Queued on {node}: GPUs {gpu_indices or 'none (CPU)'}, port {port}"
                         + (f", Ray head on port {d.master_port}." if ray else ".") + said, **said_data)
    for step, override in overrides:
        deployment_event(d, step, override.message, level="warning", **override.data)
    send_plan(d)
    return d


def _recipe_said(use: recipes.Use | None, engine_args: dict, env: dict, served_name: str, secret_env) -> tuple[str, dict]:
    """The queued step's words and data for a deploy from a recipe: which one, and what the deploy changed."""
    if use is None:
        return "", {}
    changed = recipes.recipe_changes(use, engine_args, env, served_name, secret_env)
    return " " + recipes.recipe_summary(use, changed), {
        "recipe": {"id": use.row.pk, "name": use.row.name, "source": use.row.source, "version": use.row.version,
                   "variant": use.resolved.variant, "strategy": use.resolved.strategy, "hardware": use.resolved.hardware},
        "changed": changed}


@transaction.atomic
def deployment_redeploy(d: Deployment, **changes) -> Deployment:
    """Run the plan again (restart), optionally with changed settings; a running engine is stopped first.
    A multi-node deployment's placement is checked again; `workers` (multinode.Worker) changes it.
    `recipe_use` (recipes.Use): the new settings come from that recipe, which the gate checks and the queued
    step names, as for a new deployment."""
    workers = _redeploy_workers(d, changes.pop("workers", None))  # every node's lock, in id order
    lock_node(d.node_id)
    d = Deployment.objects.select_for_update().select_related("node", "model").get(pk=d.pk)
    if d.status in Deployment.IN_FLIGHT:
        raise ServiceError(f"{d.name} is {d.get_status_display().lower()}; wait for it or stop it first.", code="busy")
    gpu_indices = changes.pop("gpu_indices", d.gpu_indices)
    user = changes.pop("user", None)
    override_fit = changes.pop("override_fit", False)
    override_compat = changes.pop("override_compat", False)
    use = changes.pop("recipe_use", None)
    reason = changes.pop("reason", "redeploy")
    old_args, old_env, was_sleep_mode = d.engine_args, d.env, d.sleep_mode
    if "engine_args" in changes:  # one spelling for every check below and the argv
        changes["engine_args"] = deploydefaults.keep_served_name(privileged.canonical(changes["engine_args"], {})[0],
                                                                 d.engine_args)
    if "env" in changes:
        changes["env"] = privileged.canonical({}, changes["env"])[1]
    for field in ("engine_args", "env"):  # secrets are write-only: a masked value sent back keeps the stored one
        if field in changes:
            changes[field] = secrets.keep_masked(changes[field], getattr(d, field))
    if "env" in changes and "secret_env" not in changes:  # marks of variables no longer set go with them
        changes["secret_env"] = [n for n in d.secret_env if n in changes["env"]]
    if problem := secrets.check_marked(changes.get("secret_env", ()), changes.get("env", d.env),
                                       changes.get("engine_args", d.engine_args)):
        raise ServiceError(problem, field="secret_env")
    changed = gpu_indices != d.gpu_indices
    d.retry_advised = changes.pop("retry_advised", False)  # a redeploy retries only when asked: it changes what was set
    for field in ("port", "engine_args", "env", "secret_env", "replace", "auto_restart", "stall_seconds", "stop_foreign", "prewarm",
                  "reuse_memory_profile",
                  "sleep_mode", "start_asleep"):
        if field in changes:
            value = changes.pop(field)
            changed |= value != getattr(d, field)
            setattr(d, field, value)
    d.engine_args, d.env = privileged.canonical(d.engine_args, d.env)  # a row stored before canonical names too
    overrides = _check(model=d.model, node=d.node, gpu_indices=gpu_indices, port=d.port, engine_args=d.engine_args,
                       replace_ids=d.replace, deployment=d, stop_foreign=d.stop_foreign, nnodes=1 + len(workers), env=d.env,
                       override_fit=override_fit, admin=is_admin(user), override_compat=override_compat,
                       resolved=use and use.resolved, sleep_mode=d.sleep_mode, start_asleep=d.start_asleep,
                       was_sleep_mode=was_sleep_mode)
    keys.names_check(user, [d.engine_args.get("served-model-name")], [d.pk, *d.replace], field="engine_args")
    multinode.check_executor(d.engine_args, 1 + len(workers))
    if not workers:  # a one-node deployment switched to or from Ray gets or drops its Ray head's port
        ray = layout.executor(d.engine_args) == "ray"
        d.master_port = (d.master_port or multinode.free_master_port(d.node)) if ray else None
    if workers:  # nodes online, GPUs free, the same engine everywhere, the model there or downloadable
        multinode.check(model=d.model, head=d.node, head_gpus=gpu_indices, workers=workers, engine_args=d.engine_args,
                        master_port=d.master_port)
    privileged.check(engine_args=d.engine_args, env=d.env, model_dir=privileged.model_dir(d.model, d.node),
                     admin=is_admin(user), old_args=old_args, old_env=old_env)
    _check_profile(d.reuse_memory_profile, d.model, d.node, gpu_indices, d.engine_args, d.env)
    d.transition(Deployment.Status.QUEUED)  # from ready too: the plan stops the running engine first
    d.smoke = {}  # the previous start's reply is not this one's (the page showed it through the new load)
    d.save()
    d.gpus.set(d.node.gpus.filter(index__in=gpu_indices))
    placed = ""
    if d.master_port and [(w.node.pk, w.gpu_indices) for w in workers] != [(r.node_id, r.gpu_indices) for r in d.ranks.all()]:
        multinode.place(d, workers, d.master_port)
        placed = " on new worker nodes: " + "; ".join(f"rank {i} on {w.node} (GPUs {w.gpu_indices or 'none, CPU'})"
                                                      for i, w in enumerate(workers, 1))
    version = versions.record(d, reason, user)
    what = versions.changes(version)
    what = (": " + "; ".join(what)) if what else (" with new settings" if changed and what is None else "")
    said, said_data = _recipe_said(use, d.engine_args, d.env, d.model.repo_id, d.secret_env)
    deployment_event(d, "queued", ("Redeploy requested" if reason == "redeploy" else reason[:1].upper() + reason[1:])
                     + f" (version {version.number})" + placed + what + "." + said, **said_data)
    for step, override in overrides:
        deployment_event(d, step, override.message, level="warning", **override.data)
    send_plan(d)
    payloads.send_deployment_status(d)
    return d


def _redeploy_workers(d: Deployment, workers) -> list[multinode.Worker]:
    """The worker nodes a redeploy runs on, their rows locked: the current ranks', or a new placement."""
    d = Deployment.objects.get(pk=d.pk)
    current = [multinode.Worker(r.node, r.gpu_indices) for r in d.ranks.select_related("node")]
    if workers is None:
        return multinode.lock_nodes(d.node, current) if current else []
    workers = list(workers)
    if not d.master_port or not workers:
        raise ServiceError("A redeploy keeps a deployment on one node or over several: deploy a new one to change that.",
                           field="workers")
    if d.systemd_unit and [(w.node.pk, sorted(w.gpu_indices)) for w in workers] != [(w.node.pk, w.gpu_indices) for w in current]:
        raise ServiceError(f"{d.name} runs as systemd units on its nodes: delete it and deploy anew to move its ranks.",
                           field="workers", code="persisted")
    return multinode.lock_nodes(d.node, workers)


@transaction.atomic
def deployment_stop(d: Deployment) -> Deployment:
    """Stop the engine (its whole process group, or its systemd unit) on the node."""
    d = Deployment.objects.select_for_update().select_related("node").get(pk=d.pk)
    if d.status in Deployment.TERMINAL:
        raise ServiceError(f"{d.name} is already {d.get_status_display().lower()}.", code="not_running")
    if d.status == Deployment.Status.STOPPING:  # the first halt may be lost (Redis emptied, a web process killed)
        deployment_event(d, "stop", "Stop requested again: the halt is sent again.")
        node_enqueue(d.node, "deployments.deployment_halt", d.pk)
        deployment_ranks_stop(d)
        return d
    d.transition(Deployment.Status.STOPPING)
    d.save()
    cancelled = repos.model_download_cancel_for(d)  # the download its plan started, if it still runs
    deployment_event(d, "stop", "Stop requested." + "".join(f" {c}" for c in cancelled))
    node_enqueue(d.node, "deployments.deployment_halt", d.pk)
    deployment_ranks_stop(d)  # every worker rank on its own node, at once
    payloads.send_deployment_status(d)
    return d


def deployment_delete(d: Deployment) -> bool:
    """Forget a stopped or failed deployment: at once (True), or, when it was made a systemd unit,
    once its node has removed the unit (False), so nothing the panel installed outlives it."""
    with transaction.atomic():
        d = Deployment.objects.select_for_update().select_related("node").get(pk=d.pk)
        if d.status not in Deployment.TERMINAL:
            raise ServiceError(f"{d.name} is {d.get_status_display().lower()}; stop it first.", code="busy")
        repos.model_download_cancel_for(d)
        if d.systemd_unit and d.ranks.exists():  # multi-node: every worker node removes its rank's unit, then the head
            workers = ", ".join(d.ranks.values_list("node__name", flat=True))
            deployment_event(d, "delete", f"Removing each rank's unit from {workers}, then {d.systemd_unit} from {d.node}, "
                             "then this deployment.")
            for r in d.ranks.select_related("node"):
                node_enqueue(r.node, "deployments.rank_forget", r.pk)
            return False
        if d.systemd_unit:
            deployment_event(d, "delete", f"Removing {d.systemd_unit} from {d.node}, then this deployment.")
            node_enqueue(d.node, "deployments.deployment_forget", d.pk)
            return False
        d.delete()
        return True


@transaction.atomic
def deployment_persist(d: Deployment) -> Deployment:
    """Ask the node to install the deployment as a systemd unit that survives reboots (multi-node: the head's
    node restarts the group with one unit per node)."""
    d = Deployment.objects.select_for_update().select_related("node").get(pk=d.pk)
    nodes = [d.node, *(r.node for r in d.ranks.select_related("node"))]  # multi-node: one unit per node
    if without := [n.name for n in nodes if not n.systemd]:
        raise ServiceError(f"{', '.join(without)} cannot keep engines across reboots (no systemd, or the agent is not "
                           "root, and engines do not run as containers); download the unit file and install it by hand.",
                           code="no_systemd")
    if d.status != Deployment.Status.READY:
        raise ServiceError("Only a ready deployment can be made a service.", code="not_running")
    if d.sleep_mode:  # systemd would start it awake at boot, beside the one that shares its GPUs
        raise ServiceError("A sleep-mode deployment cannot be made a systemd service: it shares its GPUs with other "
                           "sleep-mode deployments, and systemd would start it awake at boot.", code="no_sleep_mode")
    if layout.executor(d.engine_args) == "ray":
        raise ServiceError("A Ray deployment cannot be made a systemd service yet: its agents own its Ray nodes.",
                           code="ray")
    deployment_event(d, "persist", "Making it a service that survives crashes and reboots.")
    node_enqueue(d.node, "deployments.deployment_persist", d.pk)
    return d
