"""Engines on this node after they started: stop on request, crash detection (with auto-restart),
queued plans that expired, the live figures of ready engines, and forgetting a deleted one."""
import logging
import time

from django.db import DatabaseError
from django.utils import timezone

from deployments import payloads
from deployments.gateway import usage
from deployments.host import exits, keepers, processes, slo, vllm
from deployments.models import Deployment, DeploymentEvent
from deployments.node import energyhours, lifecycle, raycluster, units
from deployments.node.crashes import deployment_crashed
from deployments.node.lifecycle import record_shm
from deployments.node.lifecycle import running as engine_running
from deployments.node.ranks import ranks_watch
from deployments.node.steps import fail, halt_engine, mark_stopped, step_unchecked
from deployments.timeline import deployment_event

S = Deployment.Status
log = logging.getLogger(__name__)


def deployment_halt(deployment_id: int) -> Deployment:
    """Stop a deployment's engine on this node and mark it stopped."""
    d = Deployment.objects.select_related("node").get(pk=deployment_id)
    if d.status != S.STOPPING:
        return d
    if _plan_running(deployment_id):  # it stopped what it launched and the row with it
        d = Deployment.objects.select_related("node").get(pk=deployment_id)
        if d.status != S.STOPPING:
            return d
    with step_unchecked(d, "stopped") as event:
        event.message = "Engine stopped: " + halt_engine(d) + "."
    mark_stopped(d, "stopped by request")
    return d


PLAN_ABORT_WAIT_S = 15.0


def _plan_running(deployment_id: int) -> bool:
    """Whether a plan or follow of this agent drove the deployment when the Stop came; waits (PLAN_ABORT_WAIT_S at
    most) for it to end. A plan sees the Stop at its next check (each step, each second of a load) and halts what
    it launched itself: a halt from here at the same moment could read the row before the plan wrote its PID
    down, find nothing and mark it stopped while the engine went on. Past the wait the Stop halts on its own."""
    if not lifecycle.driven(deployment_id):
        return False
    deadline = time.monotonic() + PLAN_ABORT_WAIT_S
    while lifecycle.driven(deployment_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    return True


def deployment_forget(deployment_id: int) -> None:
    """On the node: remove a deleted deployment's unit (or kept container), then the deployment."""
    d = Deployment.objects.filter(pk=deployment_id).first()
    if d is None or d.status not in Deployment.TERMINAL:
        return
    if d.systemd_unit:
        try:
            keepers.uninstall(d.systemd_unit)
        except keepers.Error as exc:
            deployment_event(d, "delete", f"Not deleted: {exc}", level=DeploymentEvent.Level.ERROR)
            return
    d.delete()


WATCHED = frozenset(Deployment.UP | {S.STARTING, S.LOADING, S.QUEUED})


def deployments_watch(node_id: int, state: dict) -> None:
    """One pass of crash detection for engines that are up: process gone, or (serving) /health failing three times;
    then worker ranks, persisted engines systemd is starting again, and queued plans past their time. One light
    read says which of these have anything to look at: each node runs this every 2 s, and most of the time the
    full reads would find nothing (they cost ~5 ms of CPU a pass; perf/fleet_scale.py's agents spent 40 % of
    their ticks there)."""
    now = time.monotonic()
    rows = Deployment.objects.filter(node_id=node_id, status__in=WATCHED).values_list(
        "status", "pid", "systemd_unit", "marker", "expires_at")
    up = starting = expired = False
    wall = timezone.now()
    for status, pid, unit, marker, expires_at in rows:
        up = up or (status in Deployment.UP and pid is not None)
        starting = starting or (status in (S.STARTING, S.LOADING) and pid is None and bool(unit) and bool(marker))
        expired = expired or (status == S.QUEUED and expires_at is not None and expires_at < wall)
    if up:
        _crash_watch(node_id, state, now)
    ranks_watch(node_id)  # worker ranks this node runs for multi-node deployments
    waiting = state.setdefault("units", {})
    if starting:
        units.units_watch(node_id, waiting)  # persisted engines systemd is starting again
    else:
        waiting.clear()  # as units_watch does with deployments no longer waiting
    if expired:
        expire_queued(node_id)


def _crash_watch(node_id: int, state: dict, now: float) -> None:
    before, state["oom"] = state.get("oom"), exits.oom_kills()  # the OOM kills since the last pass saw them alive
    oom_killed = state["oom"] - before if None not in (before, state["oom"]) else 0
    for d in Deployment.objects.filter(node_id=node_id, status__in=Deployment.UP).exclude(pid=None):
        if d.status == S.SLEEPING and lifecycle.driven(d.pk):
            continue  # being woken or swapped: the wake step says how it ended
        alive = engine_running(d)
        if not alive and d.systemd_unit:  # its unit restarts it (systemd owns a persisted engine's restarts)
            units.engine_exited(d)
            state.pop(d.pk, None)
            continue
        ray_lost = alive and raycluster.uses_ray(d) and not raycluster.head_alive(d)
        alive = alive and not ray_lost
        failures = state.setdefault(d.pk, 0)
        if alive and d.status == S.SLEEPING:
            continue
        if alive and now - state.get(f"checked:{d.pk}", -1e9) >= 5:
            state[f"checked:{d.pk}"] = now
            record_shm(d)
            state[d.pk] = 0 if vllm.health(f"http://127.0.0.1:{d.port}", timeout=2.0) else failures + 1
        if alive and state[d.pk] < 3:
            continue
        reason = ("its Ray head exited" if ray_lost else
                  f"the engine process exited, {exits.explain(processes.exit_code(d.pid), oom_killed)}" if not alive
                  else "/health failed 3 times in a row")
        deployment_crashed(d, reason)
        state.pop(d.pk, None)


def expire_queued(node_id: int) -> None:
    """Queued plans the node never started in time (it was offline, or the broker lost the task)
    end failed, saying nothing was done: the task itself expired and will not run."""
    for d in Deployment.objects.filter(node_id=node_id, status=S.QUEUED, expires_at__lt=timezone.now()):
        fail(d, "The plan expired before this node ran it (the node was offline); nothing was done.")


def deployments_metrics(node_id: int, state: dict) -> None:
    """Live engine figures for ready deployments, benchmark or not: generation tok/s from the rate of
    vllm:generation_tokens_total, running and waiting requests, KV-cache use, and the SLO figures of the last
    5 minutes (TTFT p95, the share of requests aborted or failed; host/slo.py), which the notifications'
    periodic check reads from the kept message. `state`: per deployment, the last reading and its window."""
    energy = state.setdefault("energy", energyhours.EnergyHours())
    ready = list(Deployment.objects.filter(node_id=node_id, status=S.READY).exclude(pid=None).prefetch_related("gpus"))
    energy.forget({d.pk for d in ready})
    hour = usage.hour_of(timezone.now())
    for d in ready:
        try:
            t = time.monotonic()
            gauges, counters = vllm.read_engine(vllm.metrics_url(f"http://127.0.0.1:{d.port}"), timeout=2.0)
        except vllm.VllmError:
            gauges = None
        if reading := energyhours.read(d.gpu_indices, gauges):
            energy.add(d.pk, reading, hour)
        if gauges is None:
            continue
        before, window = state.get(d.pk) or (None, slo.Window())
        reading = (t, gauges)
        window.add(t, counters)
        state[d.pk] = (reading, window)
        rate = vllm.tok_s(before, reading) if before else None
        if rate is None:
            continue
        figures = window.figures()
        payloads.send_engine_figures(node_id, payloads.EngineFigures(
            id=d.pk, name=d.name, tok_s=rate, running=gauges.get("num_requests_running"),
            waiting=gauges.get("num_requests_waiting"), kv_cache=gauges.get("kv_cache_usage_perc"),
            ttft_p95_s=figures.ttft_p95_s, error_share=figures.error_share, window_requests=figures.requests,
            refused=figures.refused,
            window_s=round(figures.span_s, 1), at=time.time()))
    if energy.due(hour):
        try:
            energy.flush()
        except DatabaseError as exc:  # kept: the next flush writes it
            log.warning("node %s: the GPUs' energy not recorded yet: %s", node_id, exc)
