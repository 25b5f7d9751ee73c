"""Multi-node deployments, node side: the head's plan coordinates the worker ranks through
their nodes' own queues and the database, and each worker node's agent launches and owns its rank.

The order, as vLLM's `--nnodes` launch needs it (tensor/pipeline parallel over the mp executor):
  1. the head's plan sends `rank_run` to every worker node; each prepares (model copy, downloaded
     there when missing; holders on its node stopped) while the head prepares its own;
  2. pre-flight: the head listens on its master port, each worker opens a TCP connection to the
     head's address and reports; one that cannot fails the plan naming both nodes;
  3. workers launch `vllm serve … --headless --node-rank R` first, then the head (rank 0);
  4. health and smoke test on the head. Any rank dying fails the whole deployment and every other
     rank is stopped; Stop stops all ranks. A persisted deployment runs every rank under a systemd
     unit of its own node (the same order: each agent installs its rank's unit when told to launch),
     and systemd owns its restarts, as a persisted head's (units.py): a rank whose engine exited, or
     whose unit starts after the agent, waits in loading and is adopted once its unit's engine runs.
A data-parallel layout (DP > 1) runs the same plan with vLLM's data-parallel launch instead: the
master port is the head's DP RPC port, each worker runs `--headless` with its replicas
(`--data-parallel-size-local`) from its first DP rank (`--data-parallel-start-rank`).
"""
import logging
import time
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from deployments import claims, layout, secrets, userflags
from deployments.dispatch import node_enqueue
from deployments.host import firewall, preflight, processes, serveargv, systemd
from deployments.models import Deployment, DeploymentRank, ModelCopy
from deployments.node import lifecycle, raycluster, units
from deployments.node.cluster import head_address, multinode_args, rank_env, ranks_failed
from deployments.node.crashes import deployment_crashed
from deployments.node.lifecycle import RAY_TERM_S, STOP_TERM_S
from deployments.node.steps import (Aborted, PlanFailed, engine_user, make_room, model_ready, stop_requested,
                                    unit_install)
from deployments.timeline import deployment_event
from plumbing.queue import enqueue
from plumbing.states import InvalidTransition

log = logging.getLogger(__name__)
S = Deployment.Status
R = DeploymentRank.State
PREPARE_TIMEOUT_S = 900.0  # a worker node downloading the model reports progress on its own copy row
PREFLIGHT_TIMEOUT_S = 30.0
REACH_TIMEOUT_S = 5.0
LAUNCH_TIMEOUT_S = 60.0
POLL_S = 0.1


# --- the head's side of the plan ------------------------------------------------------------------

def ranks_send(d: Deployment) -> None:
    """Start every worker rank's part of the plan on its own node (a new plan takes any rank back to pending)."""
    for r in d.ranks.select_related("node"):
        DeploymentRank.objects.filter(pk=r.pk, state__in=DeploymentRank.sources(R.PENDING)).update(
            state=R.PENDING, message="", load_phase="", load_percent=None)
        enqueue("deployments.rank_run", args=[r.pk], queue=r.node.queue, expires=settings.HOST_TASK_EXPIRES_S)


def ranks_wait(d: Deployment, states: set, timeout_s: float, what: str) -> None:
    """Wait until every worker rank is in one of `states`; a failed rank or a stop request ends the wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        ranks_failed(d)
        if stop_requested(d):
            raise Aborted("stop requested")
        late = d.ranks.select_related("node").exclude(state__in=states)
        if not late.exists():
            return
        if time.monotonic() > deadline and not _downloading(d, late):
            raise PlanFailed(f"{what}: no answer within {timeout_s:.0f} s from node(s) "
                             + ", ".join(f"{r.node.name} ({r.get_state_display().lower()})" for r in late)
                             + "; is their agent running?")
        time.sleep(POLL_S)


def _downloading(d: Deployment, late) -> bool:
    """A late worker node still downloading the model (its copy's row moved within a minute): not late."""
    return ModelCopy.objects.filter(model=d.model, node__in=late.values("node"), state=ModelCopy.State.DOWNLOADING,
                                    updated__gt=timezone.now() - timedelta(seconds=60)).exists()


def _set(d: Deployment, state: str) -> None:
    """The head moves every worker rank on to `state` (pre-flight, launch): only ranks that may go there."""
    d.ranks.filter(state__in=DeploymentRank.sources(state)).update(state=state, updated=timezone.now())


def head_preflight(d: Deployment) -> str:
    """Listen on the master port; every worker node connects to the head's address and reports."""
    try:
        fw = firewall.check()  # the deployment's ports can be guarded here (else refused, saying why)
    except firewall.FirewallError as exc:
        raise PlanFailed(f"Head node {d.node.name}: {exc.message}") from exc
    address = head_address(d)
    ranks_wait(d, {R.PREPARED}, PREPARE_TIMEOUT_S, "Preparing the worker nodes")
    port = layout.port_name(d.engine_args)
    try:
        listener = preflight.Listener(d.master_port, host=address)  # the cluster address, never every interface
    except preflight.PreflightError as exc:
        raise PlanFailed(f"Head node {d.node.name}: {exc.message} (the {port} must be free there)") from exc
    with listener:
        _set(d, R.PREFLIGHT)
        ranks_wait(d, {R.REACHED}, PREFLIGHT_TIMEOUT_S, f"Pre-flight to head node {d.node.name} at {address}:{d.master_port}")
    names = ", ".join(d.ranks.values_list("node__name", flat=True))
    return f"Worker node(s) {names} reached head node {d.node.name} at {address}:{d.master_port} ({port}). {fw}"


def head_launch_workers(d: Deployment) -> str:
    """Workers first: each node's agent launches its headless rank; the head launches after."""
    _set(d, R.LAUNCH)
    ranks_wait(d, {R.LOADING, R.RUNNING}, LAUNCH_TIMEOUT_S, "Launching the worker ranks")
    return "; ".join(f"rank {r.rank} on {r.node.name}: PID {r.pid}" for r in d.ranks.select_related("node")) + "."


def ranks_progress(d: Deployment) -> list[dict]:
    """Every node's load, head first, for the page's side-by-side view."""
    rows = [{"node": d.node.name, "rank": 0, "state": d.status, "phase": d.load_phase, "percent": d.load_percent}]
    rows += [{"node": r.node.name, "rank": r.rank, "state": r.state, "phase": r.load_phase, "percent": r.load_percent}
             for r in d.ranks.select_related("node")]
    return rows


def deployment_rank_lost(deployment_id: int, rank_id: int) -> None:
    """On the head's node: a worker rank died. A ready deployment fails here (its engine and every other
    rank stopped, auto-restarted as a whole when asked); a plan still running notices the failed rank itself."""
    d = Deployment.objects.select_related("node", "model").get(pk=deployment_id)
    if d.status == S.READY:
        deployment_crashed(d, "every other rank was stopped")


# --- a worker node's side -------------------------------------------------------------------------

def _rank(rank_id: int) -> DeploymentRank:
    return DeploymentRank.objects.select_related("deployment__node", "deployment__model", "node").get(pk=rank_id)


def _note(r: DeploymentRank, state: str | None = None, message: str | None = None, **fields) -> None:
    """Move the rank to `state` (a guarded transition: a rank the head or a Stop moved meanwhile aborts this
    plan; one already there stays, as the watch moves a loading rank to running once the head is ready, racing
    this plan's own move) and/or record its message and load."""
    if message is not None:  # it may quote the rank's log
        fields["message"] = secrets.redact_deployment(r.deployment, message)
    if state:
        with transaction.atomic():
            row = DeploymentRank.objects.select_for_update().get(pk=r.pk)
            try:
                if row.state != state:
                    row.transition(state)
            except InvalidTransition as exc:
                raise Aborted(str(exc)) from exc
            DeploymentRank.objects.filter(pk=r.pk).update(state=state, updated=timezone.now(), **fields)
        r.state = state
    else:
        DeploymentRank.objects.filter(pk=r.pk).update(updated=timezone.now(), **fields)
    for k, v in fields.items():
        setattr(r, k, v)
    # No live status from here: r.deployment may be stale; the head's plan publishes every node's load.


def _await(r: DeploymentRank, state: str) -> None:
    """Wait for the head to move this rank to `state`; a deployment that ended or a stop aborts."""
    while True:
        r.refresh_from_db(fields=["state"])
        status = Deployment.objects.filter(pk=r.deployment_id).values_list("status", flat=True).first()
        if r.state == state:
            return
        if r.state in DeploymentRank.ENDED | {R.STOPPING} or status not in Deployment.ACTIVE or status == S.STOPPING:
            raise Aborted("the deployment ended")
        time.sleep(POLL_S)


def rank_run(rank_id: int) -> DeploymentRank:
    """On a worker node: prepare, pre-flight to the head, launch the headless rank when told, follow its load."""
    r = _rank(rank_id)
    d = r.deployment
    if r.state != R.PENDING or d.status not in Deployment.IN_FLIGHT:
        return r
    where = f"node {r.node.name}"
    try:
        _note(r, R.PREPARING, "")
        if r.pgid:
            _halt(r)  # a previous run's engine of this rank goes first
        model_path = model_ready(d, r.node)  # downloaded here, through this node's own download path
        stopped = _stop_holders(r)
        deployment_event(d, f"prepare@{r.node.name}", f"Rank {r.rank}: model at {model_path}; {stopped}", node=r.node.name)
        _note(r, R.PREPARED)
        _await(r, R.PREFLIGHT)
        address = head_address(d)
        firewall.check()  # a FirewallError (an EngineError) fails the rank naming this node
        try:
            took = preflight.reach(address, d.master_port, REACH_TIMEOUT_S)
        except preflight.PreflightError as exc:
            raise PlanFailed(f"worker node {r.node.name} cannot reach head node {d.node.name} at "
                             f"{address}:{d.master_port}: {exc.message}") from exc
        deployment_event(d, f"preflight@{r.node.name}", f"Reached head node {d.node.name} at {address}:{d.master_port} "
                         f"in {took * 1000:.1f} ms.", node=r.node.name)
        _note(r, R.REACHED)
        _await(r, R.LAUNCH)
        _launch(r, model_path)
        _note(r, R.LOADING)
        _follow(r)
    except Aborted:
        _halt(r)
        _end(r, R.STOPPED, "stopped: the deployment ended")
    except (PlanFailed, processes.EngineError) as exc:
        _give_up(r, str(exc) if where in str(exc) else f"{where}: {exc}")
    except Exception as exc:  # noqa: BLE001 - a database blip must not leave the rank mid-plan
        log.exception("rank %s: the plan broke", r)
        _give_up(r, f"{where}: the rank's plan broke ({exc.__class__.__name__}: {exc})")
    return r


def _end(r: DeploymentRank, state: str, message: str) -> None:
    """Stopped or failed, unless it ended already (a rank's end never aborts anything)."""
    try:
        _note(r, state, message)
    except Aborted:
        pass


def _give_up(r: DeploymentRank, message: str) -> None:
    _halt(r)
    _end(r, R.FAILED, message)
    deployment_event(r.deployment, f"failed@{r.node.name}", message, level="error", node=r.node.name)


def _stop_holders(r: DeploymentRank) -> str:
    """Single-node deployments on this node's chosen GPUs (the whole host without GPUs) are stopped;
    another multi-node deployment's rank is refused (stop that deployment first)."""
    d = r.deployment
    done = make_room(d, claims.deployment_holders(r.node, r.gpu_indices, exclude=d), r.node,
                     "node {node.name} is held by {other.name} (a multi-node deployment): stop it first")
    return ("stopped " + "; ".join(done)) if done else "nothing held it"


def _launch(r: DeploymentRank, model_path: str) -> None:
    """The rank's process: a headless engine (mp), or this node's Ray joining the head's cluster (ray)."""
    d = r.deployment
    address = r.node.address or "127.0.0.1"
    ray = raycluster.uses_ray(d)
    if ray:
        argv, env = raycluster.rank_argv(r), raycluster.node_env(d, address, r.gpu_indices)
    else:
        own = multinode_args(d, r.rank, d.ranks.count() + 1)
        argv = serveargv.build_argv(settings.VLLM_BIN, model_path, d.port, serveargv.API_HOST, {**d.engine_args, **own})
        env = rank_env(d, address, r.gpu_indices)
    log_path = Path(settings.VAR_DIR) / "logs" / f"{d.name}-{d.pk}-rank{r.rank}-{int(time.time())}.log"
    spec = lifecycle.Launch(argv=argv, env=env, log_path=log_path, cwd=Path(model_path),
                            role=lifecycle.RAY if ray else lifecycle.ENGINE,
                            run_as=engine_user(model_path, r.node.model_store))
    # Persisted: this node's own unit runs the rank, enabled for the next boot.
    pid = lifecycle.launch(r, spec, unit_install=lambda argv, env, log, cwd: unit_install(d, argv, env, log, rank=r.rank,
                                                                                        cwd=cwd))
    how = f"under {systemd.unit_name(d.name, r.rank)}" if d.systemd_unit else f"PID {pid}"
    what = f"Ray node joining {head_address(d)}:{d.master_port}" if ray else " ".join(userflags.argv_words(own))
    deployment_event(d, f"launch@{r.node.name}", f"Rank {r.rank}: {how}, {what} (log {log_path})", node=r.node.name)


def rank_running(r: DeploymentRank) -> bool:
    return lifecycle.running(r)


def _follow(r: DeploymentRank) -> None:
    """Follow the rank's log until the head is ready (then the agent's watch takes over)."""
    follow, saved = lifecycle.LogFollow(r), 0.0
    while True:
        follow.read()
        status = Deployment.objects.filter(pk=r.deployment_id).values_list("status", flat=True).first()
        if why := follow.exited():
            raise PlanFailed(f"node {r.node.name}: the rank's engine exited: {why}")
        if status == S.READY:
            _note(r, R.RUNNING, "", load_phase="server_up", load_percent=100.0, log_tail=follow.tail)
            return
        r.refresh_from_db(fields=["state"])
        if status not in Deployment.ACTIVE or status == S.STOPPING or r.state == R.STOPPING:
            raise Aborted("the deployment ended")
        if time.monotonic() - saved >= 1.0:
            saved = time.monotonic()
            _note(r, load_phase=follow.progress.phase, load_percent=float(follow.progress.percent), log_tail=follow.tail)
        time.sleep(0.5)


def _halt(r: DeploymentRank) -> str:
    """Stop the rank's engine group when it is provably ours (its unit first, when persisted, so it stays
    stopped after a reboot); clean its /dev/shm files."""
    halted = lifecycle.halt(r, RAY_TERM_S if layout.executor(r.deployment.engine_args) == "ray" else STOP_TERM_S)
    if halted.result and halted.result.survivors:
        raise PlanFailed(f"PIDs {halted.result.survivors} of rank {r.rank} on {r.node.name} survived SIGKILL")
    return halted.describe()


def rank_halt(rank_id: int) -> DeploymentRank:
    """On a worker node: stop the rank's engine; a failed rank stays failed, any other ends stopped."""
    r = _rank(rank_id)
    if r.state not in DeploymentRank.ENDED | {R.STOPPING}:
        return r  # a newer plan (an auto-restart) owns the rank now; its rank_run stops this engine itself
    how = _halt(r)
    DeploymentRank.objects.filter(pk=r.pk, state=R.STOPPING).update(state=R.STOPPED, message=f"stopped ({how})",
                                                                      updated=timezone.now())
    deployment_event(r.deployment, f"stopped@{r.node.name}", f"Rank {r.rank} on {r.node.name}: {how}.", node=r.node.name)
    r.refresh_from_db(fields=["state", "message"])
    return r


def ranks_watch(node_id: int) -> None:
    """One pass over the worker ranks this node runs: a dead rank fails the whole deployment (its head's
    node does that, stopping every other rank), unless its unit starts it again (a persisted deployment)."""
    if not DeploymentRank.objects.filter(node_id=node_id, state__in=DeploymentRank.ENGINE).exists():
        return  # most nodes run no rank: a quarter of the CPU of the read with its joins
    for r in DeploymentRank.objects.select_related("deployment__node", "node").filter(node_id=node_id,
                                                                                      state__in=DeploymentRank.ENGINE):
        if r.pid is None:
            if lifecycle.unit_of(r) and r.marker:
                _unit_watch(r)
            continue
        if rank_running(r):
            if r.state == R.LOADING and r.deployment.status == S.READY:
                _end(r, R.RUNNING, "")  # its rank_run task ended (an agent restart) before the head was ready
            continue
        if lifecycle.unit_of(r):
            coming, said = units.unit_coming(r)
            if coming:
                _unit_wait(r, f"the engine exited; {said}: systemd starts it again")
                continue
        _lost(r, "its engine process exited")


def _lost(r: DeploymentRank, why: str) -> None:
    """The rank's engine is gone for good: the rank fails (its unit disabled) and its head's node fails the rest."""
    with transaction.atomic():
        row = DeploymentRank.objects.select_for_update().get(pk=r.pk)
        if row.state not in DeploymentRank.ENGINE or row.pid != r.pid:
            return
        row.transition(R.FAILED, message=why)
        row.save(update_fields=["state", "message", "updated"])
    _give_up(r, f"node {r.node.name}: rank {r.rank}: {why}")
    enqueue("deployments.deployment_rank_lost", args=[r.deployment_id, r.pk], queue=r.deployment.node.queue)


def _unit_wait(r: DeploymentRank, why: str) -> None:
    """A persisted rank's engine is gone and its unit starts it again: the rank waits in "loading" naming no
    process (its marker kept: the unit's engine carries it), since when its `updated` says."""
    with transaction.atomic():
        row = DeploymentRank.objects.select_for_update().get(pk=r.pk)
        if row.state not in DeploymentRank.ENGINE or row.pid != r.pid:
            return
        if row.state == R.RUNNING:
            row.transition(R.LOADING)
        DeploymentRank.objects.filter(pk=r.pk).update(state=row.state, pid=None, pgid=None, pid_create_time=None,
                                                      message=why, updated=timezone.now())
    r.state, r.pid, r.pgid, r.pid_create_time, r.message = row.state, None, None, None, why
    deployment_event(r.deployment, f"unit_restart@{r.node.name}", f"Rank {r.rank}: {why}.", node=r.node.name)


def _unit_watch(r: DeploymentRank) -> None:
    """A persisted rank waiting for its unit: adopted once the unit's MainPID carries the marker (running again
    once the head is ready); failed when systemd gave up, or after units.UNIT_WAIT_S."""
    d = r.deployment
    if d.status not in Deployment.ACTIVE or d.status == S.STOPPING:
        return  # the head's Stop or failure halts the rank (rank_halt)
    if lifecycle.adopt(r):
        DeploymentRank.objects.filter(pk=r.pk).update(message="", updated=timezone.now())
        deployment_event(d, f"adopted@{r.node.name}", f"systemd started rank {r.rank}'s engine again under "
                         f"{lifecycle.unit_of(r)} (PID {r.pid}, proven by its marker); adopted.", node=r.node.name)
        return
    coming, said = units.unit_coming(r)
    if not coming:
        _lost(r, f"{said}: systemd will not start the engine again")
    elif (timezone.now() - r.updated).total_seconds() > units.UNIT_WAIT_S:
        _lost(r, f"{lifecycle.unit_of(r)} did not start the engine within {units.UNIT_WAIT_S:.0f} s")


def ranks_reconcile(node) -> dict:
    """On agent start: a rank whose engine still runs for an active deployment is adopted; one whose unit is
    to start it waits for it (a persisted deployment); any other is failed and its deployment told (the head
    fails the whole group)."""
    report = {"adopted": [], "failed": [], "waiting": []}
    for r in DeploymentRank.objects.select_related("deployment__node", "node").filter(node=node).exclude(
            state__in=DeploymentRank.ENDED):
        d = r.deployment
        active = d.status in Deployment.ACTIVE - {S.STOPPING}
        if r.state == R.STOPPING:
            enqueue("deployments.rank_halt", args=[r.pk], queue=node.queue)
        elif r.state in DeploymentRank.ENGINE and lifecycle.adopt(r) and active:
            report["adopted"].append(str(r))
            deployment_event(d, f"adopted@{node.name}", f"The agent of {node.name} restarted and adopted rank {r.rank} "
                             f"(PID {r.pid}).", node=node.name)
        elif (r.state in DeploymentRank.ENGINE and active and lifecycle.unit_of(r) and r.marker
              and (coming := units.unit_coming(r))[0]):
            report["waiting"].append(str(r))
            _unit_wait(r, f"the agent restarted and the engine is not running; waiting for {coming[1]}")
        else:
            report["failed"].append(str(r))
            _give_up(r, f"node {node.name}: the agent restarted and rank {r.rank} was not running")
            enqueue("deployments.deployment_rank_lost", args=[d.pk, r.pk], queue=d.node.queue)
    return report


def rank_forget(rank_id: int) -> None:
    """On a worker node, for a deleted persisted deployment: remove its rank's unit; the last rank gone,
    the head's node removes its own unit and the deployment."""
    r = DeploymentRank.objects.select_related("deployment__node", "node").filter(pk=rank_id).first()
    if r is None or r.deployment.status not in Deployment.TERMINAL:
        return
    d = r.deployment
    try:
        systemd.uninstall(systemd.unit_name(d.name, r.rank))
    except systemd.SystemdError as exc:
        deployment_event(d, "delete", f"Not deleted: {r.node.name}: {exc}", level="error", node=r.node.name)
        return
    r.delete()
    if not d.ranks.exists():
        node_enqueue(d.node, "deployments.deployment_forget", d.pk)
