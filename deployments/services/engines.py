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
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from controlpanel.states import InvalidTransition
from deployments import live, secrets
from deployments.host import engine, enginecli, engineenv, enginelog, gpu, ownership, systemd, vllm
from deployments.models import Deployment, DeploymentEvent, ModelCopy, Node
from deployments.services.deploys import _send_plan, deployment_event, deployment_holders
from deployments.services import loadtime
from deployments.services.guards import foreign_holders
from deployments.services.models import model_copy_download

log = logging.getLogger(__name__)
__all__ = ["deployment_run", "deployment_halt", "deployment_follow", "deployment_persist_here", "deployments_watch",
           "deployments_metrics",
           "deployments_reconcile", "node_engine_report", "PlanFailed", "deployment_forget"]
S = Deployment.Status
MEMORY_TIMEOUT_S = float(os.environ.get("DEPLOY_MEMORY_TIMEOUT", "180"))
STOP_TERM_S, STOP_KILL_S = 30.0, 10.0
TAIL_LINES = 400
# A deploy waiting on a download gives up when the download's row has not moved for this long
# (its worker died, or Redis/the database went away and did not come back).
DOWNLOAD_STALL_S = float(os.environ.get("DEPLOY_DOWNLOAD_STALL", "300"))


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
                      "smoke", "log_tail", "systemd_unit", "marker", "shm_files"):
            setattr(row, field, getattr(d, field))
        row.save()
    d.status, d.status_message, d.started, d.ready_at, d.stopped_at = (
        row.status, row.status_message, row.started, row.ready_at, row.stopped_at)
    live.send_deployment_status(d)


@contextmanager
def _step(d: Deployment, name: str):
    """A timeline step: start and end times, and its message (set `event.message` inside)."""
    if Deployment.objects.filter(pk=d.pk, status=S.STOPPING).exists():
        raise Aborted("stop requested")
    event = deployment_event(d, name, "…", ongoing=True)
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
        warm = loadtime.Prewarm(model_path) if d.prewarm else None  # reads while the others stop
        _set(d, S.STOPPING_OTHERS)
        with _step(d, "stop_others") as event:
            event.message = _stop_holders(d)
        with _step(d, "gpu_memory") as event:
            event.message = _wait_memory(d)
        if warm:
            with _step(d, "prewarm") as event:
                event.message = warm.wait(event)
        _set(d, S.STARTING)
        with _step(d, "launch") as event:
            event.message = _launch(d, model_path)
        _set(d, S.LOADING)
        _follow(d)
    except Aborted:
        log.info("deployment %s: plan aborted by a stop request", d.name)
    except (PlanFailed, engine.EngineError, gpu.MemoryNotReleased, systemd.SystemdError) as exc:
        _fail(d, str(exc))
    except Exception as exc:  # noqa: BLE001 - a Redis or database blip must not leave the row mid-plan
        log.exception("deployment %s: the plan broke", d.name)
        _fail(d, f"The plan broke ({exc.__class__.__name__}: {exc}); the engine was stopped.")
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
    except Exception as exc:  # noqa: BLE001 - see deployment_run
        log.exception("deployment %s: following the load broke", d.name)
        _fail(d, f"Following the load broke ({exc.__class__.__name__}: {exc}); the engine was stopped.")
    return d


def _fail(d: Deployment, message: str, attempts: int = 30) -> None:
    """Mark failed with the reason and the last log lines; never leave an engine of ours running.

    Retried while the database is away (a dropped connection, a restart): the row must not stay
    mid-plan once it is back."""
    try:
        _stop_proven(d)
    except engine.EngineError:
        pass
    if d.log_path:
        d.log_tail = "\n".join(enginelog.tail(Path(d.log_path), TAIL_LINES))
    d.pid = d.pgid = d.pid_create_time = None
    d.marker, d.shm_files = "", []
    for attempt in range(attempts):
        try:
            if connection.connection is not None and not connection.in_atomic_block:
                connection.close_if_unusable_or_obsolete()
            try:
                _set(d, S.FAILED, message)
            except Aborted:
                _stop_row(d, message)
            deployment_event(d, "failed", message, level=DeploymentEvent.Level.ERROR)
            return
        except DatabaseError:
            log.warning("deployment %s: cannot record the failure yet (database away), retrying", d.name)
            connection.close()
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
    raise PlanFailed(f"{d.name}: could not record the failure: the database stayed away")


def _running(d: Deployment) -> bool:
    """The deployment's engine leader runs and is provably ours (marker or systemd unit)."""
    return bool(d.pid) and engine.alive(d.pid, d.pid_create_time or 0.0) and ownership.pid_owned(
        d.pid, d.marker, d.systemd_unit or None)


def _stop_proven(d: Deployment) -> engine.StopResult | None:
    """Stop the deployment's process group only when it is provably its engine, then clean the
    /dev/shm files it was seen holding. A group that cannot be proven ours is reported on the
    timeline and never signalled (after a reboot or PID reuse it is someone else's)."""
    result = None
    if not d.pgid and d.marker:  # launched, but the agent died before it wrote the PID down
        marked = ownership.find(d.marker)
        d.pgid = _pgid(marked[0]) if marked else None
    if d.pgid and ownership.owned(d.pgid, d.marker, d.systemd_unit or None):
        result = engine.stop(d.pgid, STOP_TERM_S, STOP_KILL_S)
    elif d.pgid and engine.members(d.pgid):
        deployment_event(d, "not_signalled", f"Process group {d.pgid} runs but does not carry this deployment's "
                         "marker: it is not provably ours, so it was left alone.", level=DeploymentEvent.Level.WARNING)
    if not (result and result.survivors):
        engine.remove_unused_shm(set(d.shm_files or []))
        d.shm_files = []
    return result


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _adopt_marked(d: Deployment) -> bool:
    """An engine carrying the row's marker whose PID was never recorded: take it as the row's."""
    marked = ownership.find(d.marker)
    leaders = [pid for pid in marked if _pgid(pid) == pid] or marked
    if not leaders:
        return False
    d.pid, d.pgid = leaders[0], _pgid(leaders[0])
    d.pid_create_time = None
    Deployment.objects.filter(pk=d.pk).update(pid=d.pid, pgid=d.pgid, pid_create_time=None)
    return _running(d)


def _record_shm(d: Deployment) -> None:
    """Remember the engine's /dev/shm files while it runs: after a crash nothing names them."""
    if d.pgid and d.marker:
        seen = sorted(set(d.shm_files or []) | engine.shm_files(d.pgid))
        if seen != (d.shm_files or []):
            d.shm_files = seen
            Deployment.objects.filter(pk=d.pk).update(shm_files=seen)


def _ensure_model(d: Deployment) -> str:
    """The model's folder on this node; downloads it first (in this worker) when it is not here."""
    copy, _ = ModelCopy.objects.get_or_create(model=d.model, node=d.node)
    if copy.state != ModelCopy.State.READY:
        if copy.state == ModelCopy.State.DOWNLOADING:
            while copy.state == ModelCopy.State.DOWNLOADING:
                if (timezone.now() - copy.updated).total_seconds() > DOWNLOAD_STALL_S:
                    raise PlanFailed(f"The download of {d.model} made no progress for {DOWNLOAD_STALL_S:.0f} s.")
                if Deployment.objects.filter(pk=d.pk, status=S.STOPPING).exists():
                    raise Aborted("stop requested")
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
    targets = list(deployment_holders(d.node, indices, exclude=d)) + list(others.filter(pk__in=d.replace))
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
    strays = _stop_foreign(d)
    if strays:
        done.append("other processes " + ", ".join(strays))
    return "Stopped " + "; ".join(done) + "." if done else "Nothing held the chosen GPUs."


def _stop_foreign(d: Deployment) -> list[str]:
    """Processes on the chosen GPUs (the whole host without GPUs) that the panel did not start:
    the plan fails naming them, unless the deploy asked to stop them; display servers never."""
    foreign = foreign_holders(d.node_id, d.gpu_indices)
    if not foreign:
        return []
    blocking = [p for p in foreign if not p["display"]]
    if blocking and not d.stop_foreign:
        raise PlanFailed("Other processes hold the chosen GPUs: " + "; ".join(
            f"PID {p['pid']} ({p['user']}: {p['command'][:80]}{', ' + str(p['memory'] >> 20) + ' MiB' if p['memory'] else ''})"
            for p in blocking) + ". Stop them, or deploy with \"stop other processes on these GPUs\".")
    stopped = []
    for p in blocking:
        try:
            pgid = os.getpgid(p["pid"])
        except OSError:
            continue  # gone, or in another PID namespace
        if pgid in (os.getpgrp(), os.getsid(0)):
            raise PlanFailed(f"PID {p['pid']} holding the GPUs is in the agent's own process group")
        try:
            result = engine.stop(pgid, STOP_TERM_S, STOP_KILL_S)
        except engine.EngineError as exc:
            raise PlanFailed(f"cannot stop PID {p['pid']} holding the GPUs: {exc}") from exc
        stopped.append(f"PID {p['pid']} of {p['user']} ({', '.join(result.signals_sent) or 'already gone'})")
    return stopped


def _halt_engine(d: Deployment) -> str:
    """Stop one deployment's engine: its systemd unit or its whole process group; say how."""
    if d.systemd_unit:
        systemd.disable(d.systemd_unit)  # a stopped deployment must not come back at the next boot
    if not d.pgid:
        _stop_proven(d)  # its /dev/shm files, if a crash left them
        return "not running"
    result = _stop_proven(d)
    if result is None:
        d.pid = d.pgid = d.pid_create_time = None
        return "not running (its process group was not provably ours; left alone)"
    if result.survivors:
        raise PlanFailed(f"PIDs {result.survivors} of {d.name} survived SIGKILL (stuck in the driver?)")
    if d.log_path:
        d.log_tail = "\n".join(enginelog.tail(Path(d.log_path), TAIL_LINES))
    d.pid = d.pgid = d.pid_create_time = None
    shm = f", {len(result.shm_removed)} /dev/shm files removed" if result.shm_removed else ""
    return f"{' then '.join(result.signals_sent) or 'already gone'} in {result.seconds:.1f} s{shm}"


def _stop_row(d: Deployment, message: str) -> None:
    with transaction.atomic():
        row = Deployment.objects.select_for_update().get(pk=d.pk)
        row.pid = row.pgid = row.pid_create_time = None
        row.marker, row.shm_files = "", d.shm_files or []
        row.log_tail = d.log_tail or row.log_tail
        if row.status != S.STOPPED:
            row.status, row.status_message, row.stopped_at = S.STOPPED, message, timezone.now()
        row.save()
    d.status, d.pid, d.pgid = S.STOPPED, None, None
    live.send_deployment_status(row)


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
    vllm_bin = settings.VLLM_BIN
    try:
        errors = enginecli.validate_args(d.engine_args, enginecli.engine_flags(vllm_bin))
    except engine.EngineError as exc:
        raise PlanFailed(f"Cannot run the engine: {exc}") from exc
    if errors:
        raise PlanFailed("; ".join(errors.values()))
    _claim(d)
    d.marker = ownership.new_marker(d.pk)
    d.log_path = str(_log_path(d))
    Deployment.objects.filter(pk=d.pk).update(marker=d.marker, log_path=d.log_path)
    argv = enginecli.build_argv(vllm_bin, model_path, d.port, "0.0.0.0", d.engine_args)
    if d.systemd_unit:  # a persisted deployment starts under its unit again, enabled for the next boot
        text, secret_env = _unit(d, argv)
        d.pid = systemd.install(d.systemd_unit, text, secret_env=secret_env)
        d.pgid, d.pid_create_time = os.getpgid(d.pid), None
    else:
        # Started in the model's folder: a relative file flag (--chat-template t.jinja) reads from there.
        handle = engine.launch(engine.EngineSpec(argv=argv, env=_engine_env(d), log_path=Path(d.log_path),
                                                 cwd=Path(model_path)))
        d.pid, d.pgid, d.pid_create_time = handle.pid, handle.pgid, handle.create_time
    Deployment.objects.filter(pk=d.pk).update(pid=d.pid, pgid=d.pgid, pid_create_time=d.pid_create_time)
    return f"PID {d.pid}: {' '.join(argv[:3])} … (log {d.log_path})"


def _engine_env(d: Deployment) -> dict[str, str]:
    """The engine's environment. The marker is set here, by the panel, never inherited: it is
    what later proves the process is this deployment's engine."""
    return {**engineenv.deployment_env(d.env, d.gpu_indices), ownership.MARKER_VAR: d.marker}


def _unit(d: Deployment, argv: list[str]) -> tuple[str, dict[str, str]]:
    """The unit's text and its secret variables (a 0600 EnvironmentFile, not the unit text)."""
    env, secret_env = secrets.split(_engine_env(d))
    text = systemd.render_unit(description=f"vLLM {d.name} ({d.model})", env=env, log_path=d.log_path, argv=argv,
                               secret_env_file=str(systemd.env_file_path(d.systemd_unit)) if secret_env else None)
    return text, secret_env


def _claim(d: Deployment) -> None:
    """Last check before an engine starts, under the node lock every claiming path takes: no other
    active deployment holds these GPUs (the whole host on a node without GPUs)."""
    with transaction.atomic():
        Node.objects.select_for_update().get(pk=d.node_id)
        clash = deployment_holders(d.node, d.gpu_indices, exclude=d).first()
        if clash:
            raise PlanFailed(f"{clash.name} ({clash.get_status_display().lower()}) holds "
                             f"{'GPUs ' + ', '.join(map(str, d.gpu_indices)) if d.gpu_indices else 'this host'}.")


# --- loading --------------------------------------------------------------------------------

def _gpu_memory(indices: list[int]) -> dict[int, int | None]:
    if not indices:
        return {}
    try:
        return {s.index: s.memory_used for s in gpu.sample(indices)}
    except gpu.NvmlUnavailable:
        return {}


# While an engine loads, /health is asked this often: the moment it answers is when the deployment
# shows ready (perf/deploy_overhead.py: health_to_ready). The heavier bookkeeping stays at once a second.
HEALTH_POLL_S = 0.1


def _follow(d: Deployment) -> None:
    """Follow the log and GPU memory until /health answers; stalled only when both stop moving."""
    progress = enginelog.LoadProgress()
    watch = loadtime.LoadWatch(d)  # issue 16: phases, prediction, read rate
    offset, tail = 0, []
    memory = _gpu_memory(d.gpu_indices)
    moved_at = time.monotonic()
    saved_at = 0.0
    base_url = f"http://127.0.0.1:{d.port}"
    with _step(d, "load") as event:
        watch.event_id = event.pk
        while True:
            lines, offset = enginelog.read_lines(Path(d.log_path), offset)
            for line in lines:
                progress.feed(line)
            watch.feed(lines)
            if lines:
                tail = (tail + lines)[-TAIL_LINES:]
                live.send_log_lines(d.pk, secrets.redact_lines(d, lines[-200:]))
            now = time.monotonic()
            current = _gpu_memory(d.gpu_indices)
            if any(abs((current.get(i) or 0) - (memory.get(i) or 0)) > 64 << 20 for i in current):
                memory, moved_at = current, now
            if now - saved_at >= 1.0:
                saved_at = now
                d.load_phase, d.load_percent = progress.phase, float(progress.percent)
                d.load_detail = {"shards_done": progress.shards_done, "shards_total": progress.shards_total,
                                 "seconds_left": progress.seconds_left, "idle_s": round(progress.idle_s(now), 1),
                                 "gpu_memory": {str(i): m for i, m in current.items()}, **watch.detail()}
                d.log_tail = "\n".join(tail)
                Deployment.objects.filter(pk=d.pk).update(load_phase=d.load_phase, load_percent=d.load_percent,
                                                          load_detail=d.load_detail, log_tail=d.log_tail)
                _record_shm(d)
                live.send_deployment_status(d)
                if Deployment.objects.filter(pk=d.pk, status=S.STOPPING).exists():
                    raise Aborted("stop requested")
            if not _running(d):
                raise PlanFailed(f"The engine exited while loading: {progress.error or (tail[-1] if tail else 'no output')}")
            if vllm.health(base_url, timeout=1.0):
                break
            idle = min(progress.idle_s(now), now - moved_at)
            if idle > d.stall_seconds:
                raise PlanFailed(f"Stalled: neither the log nor GPU memory moved for {idle:.0f} s "
                                 f"(phase {progress.phase}, {progress.percent} %).")
            time.sleep(HEALTH_POLL_S)
        took = (timezone.now() - d.started).total_seconds() if d.started else 0
        event.message = f"Ready after {took:.0f} s" + (f" (weights {progress.weights_seconds:.0f} s)" if progress.weights_seconds else "") + "."
        if changes := watch.ready():
            event.message += f" {changes[0].upper()}{changes[1:]}."
    d.load_phase, d.load_percent = "server_up", 100.0
    d.log_tail = "\n".join(tail)
    _set(d, S.READY)
    _smoke(d, base_url)
    watch.finish()


def _smoke(d: Deployment, base_url: str) -> None:
    with _step(d, "smoke_test") as event:
        try:
            name = d.served_model_name or (vllm.served_models(base_url) or [""])[0]
            result = vllm.smoke_test(base_url, name)
        except vllm.VllmError as exc:
            event.level = DeploymentEvent.Level.WARNING
            event.message = f"The engine is up but the smoke test failed: {exc}"
            return
        d.smoke = asdict(result)
        Deployment.objects.filter(pk=d.pk).update(smoke=d.smoke)
        event.message = (f"{result.reply.strip()[:200]!r} in {result.latency_s:.2f} s, "
                         f"{result.completion_tokens} tokens" + (f" ({result.reasoning_tokens} reasoning)" if result.reasoning_tokens else ""))
    live.send_deployment_status(d)


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
    event = deployment_event(d, name, "…", ongoing=True)
    try:
        yield event
    finally:
        _end_event(event)


def _end_event(event: DeploymentEvent) -> None:
    event.ended = timezone.now()
    event.save()
    live.send_timeline_step(event)


def deployment_persist_here(deployment_id: int) -> Deployment:
    """Install the deployment as a systemd unit; the unit then owns the engine."""
    d = Deployment.objects.select_related("model", "node").get(pk=deployment_id)
    copy = ModelCopy.objects.get(model=d.model, node=d.node)
    name = systemd.unit_name(d.name)
    argv = enginecli.build_argv(settings.VLLM_BIN, copy.path, d.port, "0.0.0.0", d.engine_args)
    try:
        # The watcher skips rows without a PID: clear it first so the switch is not taken for a crash.
        Deployment.objects.filter(pk=d.pk).update(pid=None)
        _halt_engine(d)
        d.marker = ownership.new_marker(d.pk)
        d.systemd_unit = name
        text, secret_env = _unit(d, argv)
        d.pid = systemd.install(name, text, secret_env=secret_env)
        d.pgid, d.pid_create_time = os.getpgid(d.pid), None
        _set(d, S.LOADING, f"restarting under systemd as {name}")
        deployment_event(d, "persist", f"Installed {name}; systemd now starts it at boot.")
        _follow(d)
    except (systemd.SystemdError, PlanFailed, engine.EngineError, OSError, Aborted) as exc:
        _fail(d, f"Could not make it a service: {exc}")
    return d


def deployment_forget(deployment_id: int) -> None:
    """On the node: remove a deleted deployment's systemd unit, then the deployment."""
    d = Deployment.objects.filter(pk=deployment_id).first()
    if d is None or d.status not in Deployment.TERMINAL:
        return
    if d.systemd_unit:
        try:
            systemd.uninstall(d.systemd_unit)
        except systemd.SystemdError as exc:
            deployment_event(d, "delete", f"Not deleted: {exc}", level=DeploymentEvent.Level.ERROR)
            return
    d.delete()


def deployments_watch(node_id: int, state: dict) -> None:
    """One pass of crash detection for ready engines: process gone or /health failing three times."""
    now = time.monotonic()
    for d in Deployment.objects.filter(node_id=node_id, status=S.READY).exclude(pid=None):
        alive = _running(d)
        failures = state.setdefault(d.pk, 0)
        if alive and now - state.get(f"checked:{d.pk}", -1e9) >= 5:
            state[f"checked:{d.pk}"] = now
            _record_shm(d)
            state[d.pk] = 0 if vllm.health(f"http://127.0.0.1:{d.port}", timeout=2.0) else failures + 1
        if alive and state[d.pk] < 3:
            continue
        reason = "the engine process exited" if not alive else "/health failed 3 times in a row"
        _crashed(d, reason)
        state.pop(d.pk, None)
    _expire_queued(node_id)


def _expire_queued(node_id: int) -> None:
    """Queued plans the node never started in time (it was offline, or the broker lost the task)
    end failed, saying nothing was done: the task itself expired and will not run."""
    for d in Deployment.objects.filter(node_id=node_id, status=S.QUEUED, expires_at__lt=timezone.now()):
        _fail(d, "The plan expired before this node ran it (the node was offline); nothing was done.")


def deployments_metrics(node_id: int, state: dict) -> None:
    """Live engine figures for ready deployments, benchmark or not: generation tok/s from the rate of
    vllm:generation_tokens_total, running and waiting requests, KV-cache use."""
    for d in Deployment.objects.filter(node_id=node_id, status=S.READY).exclude(pid=None):
        try:
            reading = (time.monotonic(), vllm.read_metrics(vllm.metrics_url(f"http://127.0.0.1:{d.port}"), timeout=2.0))
        except vllm.VllmError:
            continue
        before, state[d.pk] = state.get(d.pk), reading
        rate = vllm.tok_s(before, reading) if before else None
        if rate is None:
            continue
        m = reading[1]
        live.send_engine_figures(node_id, live.EngineFigures(
            id=d.pk, name=d.name, tok_s=rate, running=m.get("num_requests_running"),
            waiting=m.get("num_requests_waiting"), kv_cache=m.get("kv_cache_usage_perc")))


def _crashed(d: Deployment, reason: str) -> None:
    d.log_tail = "\n".join(enginelog.tail(Path(d.log_path), TAIL_LINES)) if d.log_path else d.log_tail
    last = d.log_tail.splitlines()[-5:]
    _fail(d, f"Crashed: {reason}. Last log lines: " + " | ".join(last))
    if d.auto_restart:
        delay = min(600, 10 * 2 ** d.restarts)
        with transaction.atomic():
            Node.objects.select_for_update().get(pk=d.node_id)  # the lock every claiming path takes
            row = Deployment.objects.select_for_update().get(pk=d.pk)
            clash = deployment_holders(d.node, d.gpu_indices, exclude=d).first()
            if clash:
                deployment_event(d, "auto_restart", f"Not restarted: {clash.name} uses its GPUs now.")
                return
            row.restarts += 1
            row.transition(S.QUEUED)
            row.save()
            _send_plan(row, countdown=delay)
        deployment_event(d, "auto_restart", f"Restarting in {delay} s (restart {row.restarts}).")


def deployments_reconcile(node) -> dict:
    """On agent start: adopt engines still running, fail the dead ones, finish interrupted stops."""
    from deployments import tasks
    from deployments.services.nodes import node_enqueue

    report = {"adopted": [], "failed": [], "following": []}
    _expire_queued(node.pk)
    # A plan the killed agent had taken from the queue but not started stays unacked in the broker
    # until the visibility timeout: send it again (a duplicate finds the row moved on and returns).
    for d in Deployment.objects.filter(node=node, status=S.QUEUED):
        node_enqueue(node, tasks.deployment_run, d.pk)
    for d in Deployment.objects.filter(node=node, status__in=Deployment.ACTIVE - {S.QUEUED}):
        running = _running(d) or (not d.pid and d.status in (S.STARTING, S.LOADING) and _adopt_marked(d))
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
        flags = sorted(enginecli.engine_flags(settings.VLLM_BIN))
        Node.objects.filter(pk=node_id).update(engine_flags=flags, engine_error="", systemd=systemd.available(),
                                               engine_version=enginecli.engine_version(settings.VLLM_BIN))
    except engine.EngineError as exc:
        Node.objects.filter(pk=node_id).update(engine_flags=[], engine_error=str(exc)[:500], systemd=systemd.available())
