"""Services for deployments, node side: the deploy plan, loading, smoke test, stop, watch, reconcile.

These run in the node agent (its Celery worker threads and its sampler loop) and are the only
callers of host/engine.py, host/gpu.py's waits and host/systemd.py.
"""
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from deployments import live, secrets
from deployments.host import engine, gpu, openai, systemd
from controlpanel.states import InvalidTransition
from deployments.models import Deployment, DeploymentEvent, ModelCopy
from deployments.services.deploys import _send_plan, deployment_event, deployment_publish
from deployments.services.models import model_copy_download

log = logging.getLogger(__name__)
__all__ = ["deployment_run", "deployment_halt", "deployment_follow", "deployment_persist_here", "deployments_watch",
           "deployments_metrics",
           "deployments_reconcile", "node_engine_report", "PlanFailed"]
S = Deployment.Status
MEMORY_TIMEOUT_S = float(os.environ.get("DEPLOY_MEMORY_TIMEOUT", "180"))
STOP_TERM_S, STOP_KILL_S = 30.0, 10.0
TAIL_LINES = 400


class PlanFailed(Exception):
    """A deploy step failed; the message says why, for the timeline and the status."""


class Aborted(Exception):
    """Someone asked to stop the deployment while its plan ran."""


def _set(d: Deployment, status: str, message: str = "") -> None:
    """Move to `status` unless the row moved meanwhile (a stop request): then abort the plan."""
    with transaction.atomic():
        row = Deployment.objects.select_for_update().get(pk=d.pk)
        try:
            row.transition(status, message)
        except InvalidTransition as exc:
            raise Aborted(str(exc)) from exc
        for field in ("pid", "pgid", "pid_create_time", "log_path", "load_phase", "load_percent", "load_detail",
                      "smoke", "log_tail", "systemd_unit"):
            setattr(row, field, getattr(d, field))
        row.save()
    d.status, d.status_message, d.started, d.ready_at, d.stopped_at = (
        row.status, row.status_message, row.started, row.ready_at, row.stopped_at)
    deployment_publish(d)


@contextmanager
def _step(d: Deployment, name: str):
    """A timeline step: start and end times, and its message (set `event.message` inside)."""
    if Deployment.objects.filter(pk=d.pk, status=S.STOPPING).exists():
        raise Aborted("stop requested")
    event = deployment_event(d, name, "…")
    try:
        yield event
    except Exception as exc:
        event.level = DeploymentEvent.Level.ERROR
        event.message = str(exc) or exc.__class__.__name__
        raise
    finally:
        _end_event(event)


def _log_path(d: Deployment) -> Path:
    return Path(settings.VAR_DIR) / "logs" / f"{d.name}-{d.pk}-{int(time.time())}.log"


# --- the plan -------------------------------------------------------------------------------

def deployment_run(deployment_id: int) -> Deployment:
    """The deploy plan, step by step: model, stop holders, memory back, launch, load, smoke test."""
    d = Deployment.objects.select_related("model", "node").get(pk=deployment_id)
    if d.status != S.QUEUED:
        return d  # stopped or already running: a stale or duplicate message
    try:
        _set(d, S.PREPARING)
        with _step(d, "model") as event:
            model_path = _ensure_model(d)
            event.message = f"{d.model} is at {model_path}."
        _set(d, S.STOPPING_OTHERS)
        with _step(d, "stop_others") as event:
            event.message = _stop_holders(d)
        with _step(d, "gpu_memory") as event:
            event.message = _wait_memory(d)
        _set(d, S.STARTING)
        with _step(d, "launch") as event:
            event.message = _launch(d, model_path)
        _set(d, S.LOADING)
        _follow(d)
    except Aborted:
        log.info("deployment %s: plan aborted by a stop request", d.name)
    except (PlanFailed, engine.EngineError, gpu.MemoryNotReleased, systemd.SystemdError) as exc:
        _fail(d, str(exc))
    return d


def deployment_follow(deployment_id: int) -> Deployment:
    """Follow an engine that is already loading (after an agent restart) until it is ready."""
    d = Deployment.objects.select_related("model", "node").get(pk=deployment_id)
    if d.status not in (S.STARTING, S.LOADING) or not d.pid:
        return d
    try:
        if d.status == S.STARTING:
            _set(d, S.LOADING)
        _follow(d)
    except Aborted:
        pass
    except (PlanFailed, engine.EngineError) as exc:
        _fail(d, str(exc))
    return d


def _fail(d: Deployment, message: str) -> None:
    """Mark failed with the reason and the last log lines; never leave an engine running behind."""
    if d.pgid:
        try:
            engine.stop(d.pgid, STOP_TERM_S, STOP_KILL_S)
        except engine.EngineError:
            pass
    if d.log_path:
        d.log_tail = "\n".join(engine.tail(Path(d.log_path), TAIL_LINES))
    d.pid = d.pgid = None
    try:
        _set(d, S.FAILED, message)
    except Aborted:
        _stop_row(d, message)
    deployment_event(d, "failed", message, level=DeploymentEvent.Level.ERROR)


def _ensure_model(d: Deployment) -> str:
    """The model's folder on this node; downloads it first (in this worker) when it is not here."""
    copy, _ = ModelCopy.objects.get_or_create(model=d.model, node=d.node)
    if copy.state != ModelCopy.State.READY:
        if copy.state == ModelCopy.State.DOWNLOADING:
            while copy.state == ModelCopy.State.DOWNLOADING:
                time.sleep(2)
                copy.refresh_from_db()
        else:
            with transaction.atomic():
                copy = ModelCopy.objects.select_for_update().get(pk=copy.pk)
                try:
                    copy.transition(ModelCopy.State.QUEUED, bytes_total=d.model.total_size, cancel_requested=False)
                except InvalidTransition as exc:  # being deleted
                    raise PlanFailed(f"The model's copy on {d.node} is {copy.get_state_display().lower()}.") from exc
                copy.save()
            copy = model_copy_download(copy.pk)
        if copy.state != ModelCopy.State.READY:
            raise PlanFailed(f"The model could not be downloaded: {copy.error or copy.state}")
    ModelCopy.objects.filter(pk=copy.pk).update(last_used=timezone.now())
    return copy.path


def _stop_holders(d: Deployment) -> str:
    """Stop deployments on the chosen GPUs (and those asked for), then stray GPU processes."""
    indices = d.gpu_indices
    others = Deployment.objects.filter(node=d.node, status__in=Deployment.ACTIVE).exclude(pk=d.pk)
    targets = list(others.filter(gpus__index__in=indices).distinct()) + list(others.filter(pk__in=d.replace))
    done = []
    if d.pid or d.systemd_unit:  # a redeploy: our own previous engine goes first
        result = _halt_engine(d)
        done.append(f"the previous engine of {d.name} ({result})")
    for other in {o.pk: o for o in targets}.values():
        if other.status != S.STOPPING:
            try:
                _set(other, S.STOPPING, f"stopped to make room for {d.name}")
            except Aborted:
                continue
        result = _halt_engine(other)
        _stop_row(other, f"stopped to make room for {d.name}")
        done.append(f"{other.name} ({result})")
    strays = _stop_strays(indices)
    if strays:
        done.append("stray processes " + ", ".join(strays))
    return "Stopped " + "; ".join(done) + "." if done else "Nothing held the chosen GPUs."


def _stop_strays(indices: list[int]) -> list[str]:
    """Process groups still holding the chosen GPUs that no deployment owns: TERM, then KILL."""
    try:
        held = gpu.processes_on(indices)
    except gpu.NvmlUnavailable:
        return []
    stopped = []
    for pid in sorted({p.pid for procs in held.values() for p in procs}):
        try:
            pgid = os.getpgid(pid)
        except OSError:
            continue  # gone, or in another PID namespace
        try:
            result = engine.stop(pgid, STOP_TERM_S, STOP_KILL_S)
        except engine.EngineError as exc:
            raise PlanFailed(f"cannot stop PID {pid} holding the GPUs: {exc}") from exc
        stopped.append(f"PID {pid} ({', '.join(result.signals_sent) or 'already gone'})")
    return stopped


def _halt_engine(d: Deployment) -> str:
    """Stop one deployment's engine: its systemd unit or its whole process group; say how."""
    if d.systemd_unit:
        systemd.stop(d.systemd_unit)
    if not d.pgid:
        return "not running"
    result = engine.stop(d.pgid, STOP_TERM_S, STOP_KILL_S)
    if result.survivors:
        raise PlanFailed(f"PIDs {result.survivors} of {d.name} survived SIGKILL (stuck in the driver?)")
    if d.log_path:
        d.log_tail = "\n".join(engine.tail(Path(d.log_path), TAIL_LINES))
    d.pid = d.pgid = d.pid_create_time = None
    shm = f", {len(result.shm_removed)} /dev/shm files removed" if result.shm_removed else ""
    return f"{' then '.join(result.signals_sent) or 'already gone'} in {result.seconds:.1f} s{shm}"


def _stop_row(d: Deployment, message: str) -> None:
    with transaction.atomic():
        row = Deployment.objects.select_for_update().get(pk=d.pk)
        row.pid = row.pgid = row.pid_create_time = None
        row.log_tail = d.log_tail or row.log_tail
        if row.status != S.STOPPED:
            row.status, row.status_message, row.stopped_at = S.STOPPED, message, timezone.now()
        row.save()
    d.status, d.pid, d.pgid = S.STOPPED, None, None
    deployment_publish(row)


def _wait_memory(d: Deployment) -> str:
    indices = d.gpu_indices
    if not indices:
        return "No GPUs chosen (CPU engine): nothing to wait for."
    started = time.monotonic()
    try:
        gpu.wait_memory_released(indices, pids=None, timeout_s=MEMORY_TIMEOUT_S)
    except gpu.NvmlUnavailable:
        return "No NVIDIA GPU on this node: skipped."
    return f"GPU memory of GPUs {', '.join(map(str, indices))} released after {time.monotonic() - started:.1f} s."


def _launch(d: Deployment, model_path: str) -> str:
    if not engine.port_free("0.0.0.0", d.port):
        raise PlanFailed(f"Port {d.port} is in use on {d.node}: choose another port or stop what listens there.")
    vllm = settings.VLLM_BIN
    try:
        errors = engine.validate_args(d.engine_args, engine.engine_flags(vllm))
    except engine.EngineError as exc:
        raise PlanFailed(f"Cannot run the engine: {exc}") from exc
    if errors:
        raise PlanFailed("; ".join(errors.values()))
    env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", **d.env}
    if d.gpu_indices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, d.gpu_indices))
    d.log_path = str(_log_path(d))
    argv = engine.build_argv(vllm, model_path, d.port, "0.0.0.0", d.engine_args)
    # Started in the model's folder: a relative file flag (--chat-template t.jinja) reads from there.
    handle = engine.launch(engine.EngineSpec(argv=argv, env=env, log_path=Path(d.log_path), cwd=Path(model_path)))
    d.pid, d.pgid, d.pid_create_time = handle.pid, handle.pgid, handle.create_time
    Deployment.objects.filter(pk=d.pk).update(pid=d.pid, pgid=d.pgid, pid_create_time=d.pid_create_time, log_path=d.log_path)
    return f"PID {handle.pid}: {' '.join(argv[:3])} … (log {d.log_path})"


# --- loading --------------------------------------------------------------------------------

def _gpu_memory(indices: list[int]) -> dict[int, int | None]:
    if not indices:
        return {}
    try:
        return {s.index: s.memory_used for s in gpu.sample(indices)}
    except gpu.NvmlUnavailable:
        return {}


def _follow(d: Deployment) -> None:
    """Follow the log and GPU memory until /health answers; stalled only when both stop moving."""
    progress = engine.LoadProgress()
    offset, tail = 0, []
    memory = _gpu_memory(d.gpu_indices)
    moved_at = time.monotonic()
    saved_at = 0.0
    base_url = f"http://127.0.0.1:{d.port}"
    with _step(d, "load") as event:
        while True:
            lines, offset = engine.read_lines(Path(d.log_path), offset)
            for line in lines:
                progress.feed(line)
            if lines:
                tail = (tail + lines)[-TAIL_LINES:]
                live.publish(live.deployment_topic(d.pk), "log", {"lines": secrets.redact_lines(d, lines[-200:])}, keep=False)
            now = time.monotonic()
            current = _gpu_memory(d.gpu_indices)
            if any(abs((current.get(i) or 0) - (memory.get(i) or 0)) > 64 << 20 for i in current):
                memory, moved_at = current, now
            if now - saved_at >= 1.0:
                saved_at = now
                d.load_phase, d.load_percent = progress.phase, float(progress.percent)
                d.load_detail = {"shards_done": progress.shards_done, "shards_total": progress.shards_total,
                                 "seconds_left": progress.seconds_left, "idle_s": round(progress.idle_s(now), 1),
                                 "gpu_memory": {str(i): m for i, m in current.items()}}
                d.log_tail = "\n".join(tail)
                Deployment.objects.filter(pk=d.pk).update(load_phase=d.load_phase, load_percent=d.load_percent,
                                                          load_detail=d.load_detail, log_tail=d.log_tail)
                deployment_publish(d)
                if Deployment.objects.filter(pk=d.pk, status=S.STOPPING).exists():
                    raise Aborted("stop requested")
            if not engine.alive(d.pid, d.pid_create_time or 0.0):
                raise PlanFailed(f"The engine exited while loading: {progress.error or (tail[-1] if tail else 'no output')}")
            if engine.health(base_url, timeout=1.0):
                break
            idle = min(progress.idle_s(now), now - moved_at)
            if idle > d.stall_seconds:
                raise PlanFailed(f"Stalled: neither the log nor GPU memory moved for {idle:.0f} s "
                                 f"(phase {progress.phase}, {progress.percent} %).")
            time.sleep(0.5)
        took = (timezone.now() - d.started).total_seconds() if d.started else 0
        event.message = f"Ready after {took:.0f} s" + (f" (weights {progress.weights_seconds:.0f} s)" if progress.weights_seconds else "") + "."
    d.load_phase, d.load_percent = "server_up", 100.0
    d.log_tail = "\n".join(tail)
    _set(d, S.READY)
    _smoke(d, base_url)


def _smoke(d: Deployment, base_url: str) -> None:
    with _step(d, "smoke_test") as event:
        try:
            name = d.served_model_name or (openai.served_models(base_url) or [""])[0]
            result = openai.smoke_test(base_url, name)
        except openai.OpenAIError as exc:
            event.level = DeploymentEvent.Level.WARNING
            event.message = f"The engine is up but the smoke test failed: {exc}"
            return
        d.smoke = asdict(result)
        Deployment.objects.filter(pk=d.pk).update(smoke=d.smoke)
        event.message = (f"{result.reply.strip()[:200]!r} in {result.latency_s:.2f} s, "
                         f"{result.completion_tokens} tokens" + (f" ({result.reasoning_tokens} reasoning)" if result.reasoning_tokens else ""))
    deployment_publish(d)


# --- stop, persist, watch, reconcile ---------------------------------------------------------

def deployment_halt(deployment_id: int) -> Deployment:
    """Stop a deployment's engine on this node and mark it stopped."""
    d = Deployment.objects.select_related("node").get(pk=deployment_id)
    if d.status != S.STOPPING:
        return d
    with _step_unchecked(d, "stopped") as event:
        event.message = "Engine stopped: " + _halt_engine(d) + "."
    _stop_row(d, "stopped by request")
    return d


@contextmanager
def _step_unchecked(d: Deployment, name: str):
    """A timeline step that runs even while the deployment is stopping."""
    event = deployment_event(d, name, "…")
    try:
        yield event
    finally:
        _end_event(event)


def _end_event(event: DeploymentEvent) -> None:
    from deployments.services.deploys import _publish_event

    event.ended = timezone.now()
    event.save()
    _publish_event(event)


def deployment_persist_here(deployment_id: int) -> Deployment:
    """Install the deployment as a systemd unit; the unit then owns the engine."""
    d = Deployment.objects.select_related("model", "node").get(pk=deployment_id)
    copy = ModelCopy.objects.get(model=d.model, node=d.node)
    env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", **d.env}
    if d.gpu_indices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, d.gpu_indices))
    name = systemd.unit_name(d.name)
    env, secret_env = secrets.split(env)  # secrets go in a 0600 EnvironmentFile, not in the unit text
    text = systemd.render_unit(description=f"vLLM {d.name} ({d.model})", env=env, log_path=d.log_path,
                               argv=engine.build_argv(settings.VLLM_BIN, copy.path, d.port, "0.0.0.0", d.engine_args),
                               secret_env_file=str(systemd.env_file_path(name)) if secret_env else None)
    try:
        # The watcher skips rows without a PID: clear it first so the switch is not taken for a crash.
        Deployment.objects.filter(pk=d.pk).update(pid=None)
        _halt_engine(d)
        d.systemd_unit = name
        d.pid = systemd.install(name, text, secret_env=secret_env)
        d.pgid, d.pid_create_time = os.getpgid(d.pid), None
        _set(d, S.LOADING, f"restarting under systemd as {name}")
        deployment_event(d, "persist", f"Installed {name}; systemd now starts it at boot.")
        _follow(d)
    except (systemd.SystemdError, PlanFailed, engine.EngineError, OSError, Aborted) as exc:
        _fail(d, f"Could not make it a service: {exc}")
    return d


def deployments_watch(node_id: int, state: dict) -> None:
    """One pass of crash detection for ready engines: process gone or /health failing three times."""
    now = time.monotonic()
    for d in Deployment.objects.filter(node_id=node_id, status=S.READY).exclude(pid=None):
        alive = engine.alive(d.pid, d.pid_create_time or 0.0)
        failures = state.setdefault(d.pk, 0)
        if alive and now - state.get(f"checked:{d.pk}", -1e9) >= 5:
            state[f"checked:{d.pk}"] = now
            state[d.pk] = 0 if engine.health(f"http://127.0.0.1:{d.port}", timeout=2.0) else failures + 1
        if alive and state[d.pk] < 3:
            continue
        reason = "the engine process exited" if not alive else "/health failed 3 times in a row"
        _crashed(d, reason)
        state.pop(d.pk, None)


def deployments_metrics(node_id: int, state: dict) -> None:
    """Live engine figures for ready deployments, benchmark or not: generation tok/s from the rate of
    vllm:generation_tokens_total, running and waiting requests, KV-cache use."""
    for d in Deployment.objects.filter(node_id=node_id, status=S.READY).exclude(pid=None):
        try:
            m = openai.metrics(f"http://127.0.0.1:{d.port}", timeout=2.0)
        except openai.OpenAIError:
            continue
        now, total = time.monotonic(), m.get("vllm:generation_tokens_total", 0.0)
        before = state.get(d.pk)
        state[d.pk] = (now, total)
        if before is None or now <= before[0]:
            continue
        payload = {"id": d.pk, "name": d.name, "tok_s": max(0.0, (total - before[1]) / (now - before[0])),
                   "running": m.get("vllm:num_requests_running"), "waiting": m.get("vllm:num_requests_waiting"),
                   "kv_cache": m.get("vllm:kv_cache_usage_perc", m.get("vllm:gpu_cache_usage_perc"))}
        live.publish(live.deployment_topic(d.pk), "engine", payload)
        live.publish(live.node_topic(node_id), f"engine.{d.pk}", payload)


def _crashed(d: Deployment, reason: str) -> None:
    d.log_tail = "\n".join(engine.tail(Path(d.log_path), TAIL_LINES)) if d.log_path else d.log_tail
    last = d.log_tail.splitlines()[-5:]
    _fail(d, f"Crashed: {reason}. Last log lines: " + " | ".join(last))
    if d.auto_restart:
        delay = min(600, 10 * 2 ** d.restarts)
        with transaction.atomic():
            row = Deployment.objects.select_for_update().get(pk=d.pk)
            row.restarts += 1
            row.transition(S.QUEUED)
            row.save()
        deployment_event(d, "auto_restart", f"Restarting in {delay} s (restart {row.restarts}).")
        _send_plan(row, countdown=delay)


def deployments_reconcile(node) -> dict:
    """On agent start: adopt engines still running, fail the dead ones, finish interrupted stops."""
    from deployments import tasks
    from deployments.services.nodes import node_enqueue

    report = {"adopted": [], "failed": [], "following": []}
    for d in Deployment.objects.filter(node=node, status__in=Deployment.ACTIVE - {S.QUEUED}):
        running = bool(d.pid) and engine.alive(d.pid, d.pid_create_time or 0.0)
        if d.status == S.STOPPING:
            node_enqueue(node, tasks.deployment_halt, d.pk)
        elif running and d.status == S.READY:
            report["adopted"].append(d.name)
            deployment_event(d, "adopted", f"The agent restarted and adopted the running engine (PID {d.pid}).")
        elif running and d.status in (S.STARTING, S.LOADING):
            report["following"].append(d.name)
            node_enqueue(node, tasks.deployment_follow, d.pk)
        else:
            report["failed"].append(d.name)
            _fail(d, "The node agent restarted and the engine is not running (or the plan was interrupted); redeploy it.")
    return report


def node_engine_report(node_id: int) -> None:
    """Record which vLLM this node runs and the flags it accepts (used to validate deploy forms)."""
    from deployments.models import Node

    try:
        flags = sorted(engine.engine_flags(settings.VLLM_BIN))
        Node.objects.filter(pk=node_id).update(engine_flags=flags, engine_error="", systemd=systemd.available(),
                                               engine_version=engine.engine_version(settings.VLLM_BIN))
    except engine.EngineError as exc:
        Node.objects.filter(pk=node_id).update(engine_flags=[], engine_error=str(exc)[:500], systemd=systemd.available())
