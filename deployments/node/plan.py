"""The deploy plan on the node, step by step: model, stop holders, memory back, launch, load,
smoke test; following a load after an agent restart; re-launching under systemd (persist)."""
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from deployments import claims, engineapikey, loads, payloads, warmstart
from deployments.gateway import media
from deployments.host import (gpu, gpuwait, keepers, listeners, ownership, processenv, processes, serveargv,
                              startcauses, supervisors, systemd, vllm)
from deployments.models import Deployment, DeploymentEvent
from deployments.node import cluster, crashes, guards, lifecycle, precheck, ranks, raycluster, sleep
from deployments.node.lifecycle import STOP_KILL_S, STOP_TERM_S, record_shm
from deployments.node.steps import (Aborted, PlanFailed, engine_user, fail, halt_engine, make_room, mark_stopped,
                                    model_ready, move, step, stop_requested, unit_install, unit_text)
from deployments.timeline import deployment_event

log = logging.getLogger(__name__)
S = Deployment.Status
MEMORY_TIMEOUT_S = float(os.environ.get("DEPLOY_MEMORY_TIMEOUT", "180"))


def deployment_run(deployment_id: int) -> Deployment:
    """The deploy plan, step by step: model, stop holders, memory back, launch, load, smoke test."""
    with lifecycle.driving(deployment_id):
        return _run(deployment_id)


def _run(deployment_id: int) -> Deployment:
    d = Deployment.objects.select_related("model", "node").get(pk=deployment_id)
    if d.status != S.QUEUED:
        return d  # stopped or already running: a stale or duplicate message
    try:
        move(d, S.PREPARING)
        if d.master_port:  # multi-node: every worker node prepares its rank meanwhile
            ranks.ranks_send(d)
        with step(d, "model") as event:
            model_path = model_ready(d, d.node)
            event.message = f"{d.model} is at {model_path}."
        with step(d, "checks") as event:  # everything that can fail, before anything serving is stopped
            event.message = precheck.checks(d)
        warm = loads.Prewarm(model_path) if d.prewarm else None  # reads while the others stop
        swap_from = (d.load_detail or {}).get("swap_from")
        move(d, S.STOPPING_OTHERS)
        slept = []
        if sleep.sharing(d):  # sleep-mode deployments on these GPUs go to sleep, not away
            with step(d, "sleep_others") as event:
                event.message, slept = sleep.make_way(d)
        with step(d, "stop_others") as event:
            event.message = _stop_holders(d)
        with step(d, "gpu_memory") as event:
            event.message = _wait_memory(d)
        if warm:
            with step(d, "prewarm") as event:
                event.message = warm.wait(event)
        spans = d.master_port and d.ranks.exists()
        if spans:
            with step(d, "preflight") as event:
                event.message = ranks.head_preflight(d)
        move(d, S.STARTING)
        ray = raycluster.uses_ray(d)
        if ray:  # multi-node with Ray: the Ray head, then each worker node's Ray joins it
            with step(d, "ray_head") as event:
                event.message = raycluster.head_start(d)
        if spans:  # workers first, as vLLM's multi-node launch needs
            with step(d, "launch_workers") as event:
                event.message = ranks.head_launch_workers(d)
        if ray:
            with step(d, "ray_cluster") as event:
                event.message = raycluster.cluster_wait(d)
        with step(d, "launch") as event:
            event.message = _launch(d, model_path)
        move(d, S.LOADING)
        _follow(d)
        sleep.after_load(d, slept, swap_from)
    except Aborted:
        log.info("deployment %s: plan aborted by a stop request", d.name)
        _halt_own_launch(d)
    except (PlanFailed, processes.EngineError, gpu.MemoryNotReleased, *keepers.Error) as exc:
        if stop_requested(d):  # e.g. the engine the Stop ended "exited"
            log.info("deployment %s: %s, after a stop request: stopped, not failed", d.name, exc)
            _halt_own_launch(d)
        else:
            fail(d, str(exc))
            if isinstance(exc, StartFailed) and exc.cause and exc.cause.retryable and d.retry_advised:
                _retry_advised(d, exc.cause)
    except Exception as exc:  # noqa: BLE001 - a Redis or database blip must not leave the row mid-plan
        log.exception("deployment %s: the plan broke", d.name)
        fail(d, f"The plan broke ({exc.__class__.__name__}: {exc}); the engine was stopped.")
    return d


class StartFailed(PlanFailed):
    """The engine exited while it loaded; `cause`: what its log says ended it (startcauses.Cause), or None."""

    def __init__(self, message: str, cause: startcauses.Cause | None):
        super().__init__(message)
        self.cause = cause


def _retry_advised(d: Deployment, cause: startcauses.Cause) -> None:
    """The one automatic retry a deployment asked for (retry_advised, then used up): its plan again with the fix."""
    args = {**d.engine_args, **{flag: str(value) for flag, value in cause.fix.items()}}
    changes = ", ".join(f"--{flag} {value}" for flag, value in cause.fix.items())
    if crashes.requeue(d, "advised_retry", engine_args=args, retry_advised=False):
        deployment_event(d, "advised_retry", f"Starting once more with {changes} (asked for at deploy: one retry with "
                         f"the advised setting): {cause.sentence}")


def _halt_own_launch(d: Deployment) -> None:
    """A Stop that landed while this plan launched: the Stop's own halt may have read the row before the PID was
    in it, or looked for the marker before the new process carried it, and found nothing to stop. So the plan
    stops what it launched itself, once the process can be proven ours (its environment readable after exec),
    and the row is stopped with nothing left behind."""
    if not (d.pid or d.marker):
        return  # aborted before the launch: nothing of this plan's runs
    if d.pid and processes.alive(d.pid, d.pid_create_time or 0.0):
        lifecycle.still_running(d, tries=50, wait_s=0.1)  # until it carries its marker, after its exec
    try:
        message = halt_engine(d)
    except (processes.EngineError, *keepers.Error, PlanFailed) as exc:
        fail(d, f"Stopping the engine this plan launched: {exc}")
        return
    deployment_event(d, "stopped", f"Engine the plan had launched stopped: {message}.")
    with transaction.atomic():  # unless the Stop's own halt got there first, or a new deploy came since
        if Deployment.objects.select_for_update().filter(pk=d.pk, status=S.STOPPING).exists():
            mark_stopped(d, "stopped by request")


def deployment_follow(deployment_id: int) -> Deployment:
    """Follow an engine that is already loading (after an agent restart) until it is ready; nothing when a plan
    or another follow of this agent drives it already."""
    with lifecycle.driving(deployment_id) as mine:
        d = Deployment.objects.select_related("model", "node").get(pk=deployment_id)
        if mine:
            _follow_again(d)
        return d


def _follow_again(d: Deployment) -> None:
    if d.status not in (S.STARTING, S.LOADING) or not d.pid:
        return
    try:
        if d.status == S.STARTING:
            move(d, S.LOADING)
        _follow(d, fresh=False)
    except Aborted:
        pass
    except (PlanFailed, processes.EngineError) as exc:
        fail(d, str(exc))
    except Exception as exc:  # noqa: BLE001 - see deployment_run
        log.exception("deployment %s: following the load broke", d.name)
        fail(d, f"Following the load broke ({exc.__class__.__name__}: {exc}); the engine was stopped.")


def _stop_holders(d: Deployment) -> str:
    """Stop deployments on the chosen GPUs (and those asked for), then stray GPU processes."""
    targets = precheck.to_stop(d)
    done = []
    if d.pid or d.systemd_unit:  # a redeploy: our own previous engine goes first
        result = halt_engine(d)
        done.append(f"the previous engine of {d.name} ({result})")
    done += make_room(d, targets, d.node, "{other.name} (a multi-node deployment with its head on {other.node}) "
                                          "has a rank on {node}: stop it first.")
    strays = _stop_foreign(d)
    if strays:
        done.append("other processes " + "; ".join(strays))
    return "Stopped " + "; ".join(done) + "." if done else "Nothing held the chosen GPUs."


def _stop_foreign(d: Deployment) -> list[str]:
    """Processes on the chosen GPUs (the whole host without GPUs) that the panel did not start:
    the plan fails naming them, unless the deploy asked to stop them; display servers never.
    Exactly the holders and their own children are signalled, never the rest of their session; a holder under a
    systemd unit or in a container is stopped through that manager instead, which would bring it back."""
    blocking = precheck.blocking_foreign(d)  # again: one may have started since the checks
    if blocking and not d.stop_foreign:
        raise PlanFailed(precheck.foreign_refusal(blocking))
    if not blocking:
        return []
    try:
        done, bare = guards.stop_supervised(blocking)
        result = ownership.stop_holders([p["pid"] for p in bare], STOP_TERM_S, STOP_KILL_S)
    except (ownership.RefusedToSignal, supervisors.SupervisorError, systemd.SystemdError) as exc:
        raise PlanFailed(f"Cannot stop the processes holding the GPUs: {exc}") from exc
    if result.survivors:
        raise PlanFailed("Processes holding the GPUs survived SIGKILL: " + ", ".join(
            f"PID {pid}" for pid in result.survivors) + " (stuck in the driver?).")
    if not result.signalled:
        return done
    named = ", ".join(f"PID {p['pid']} of {p['user']} ({p['command'][:120]}"
                      + ("" if p["holder"] == p["pid"] else f"; a child of PID {p['holder']}") + ")"
                      for p in result.signalled)
    return done + [f"{named}: {' then '.join(result.signals) or 'already gone'}"]


def _wait_memory(d: Deployment) -> str:
    indices = d.gpu_indices
    if not indices:
        return "No GPUs chosen (CPU engine): nothing to wait for."
    started = time.monotonic()
    try:  # display servers are never stopped: their memory stays, and is named
        kept = gpuwait.wait_memory_released(indices, pids=None, timeout_s=MEMORY_TIMEOUT_S,
                                            ignore=sleep.sharing_pids(d))
    except gpu.NvmlUnavailable:
        return "No NVIDIA GPU on this node: skipped."
    return (f"GPU memory of GPUs {', '.join(map(str, indices))} released after {time.monotonic() - started:.1f} s."
            + gpuwait.kept_text(kept))


def _launch(d: Deployment, model_path: str) -> str:
    if not processes.port_free("0.0.0.0", d.port):
        raise PlanFailed(f"Port {d.port} is in use on {d.node}: choose another port or stop what listens there.")
    vllm_bin = settings.VLLM_BIN
    flags = precheck.engine_flags()  # checked before anything was stopped; the engine could have gone since
    _claim(d)
    ray = raycluster.uses_ray(d)
    mp_launch = d.master_port and not ray  # vLLM's own multi-node launch; Ray places the workers itself
    args = {**d.engine_args, **cluster.multinode_args(d, 0, d.ranks.count() + 1)} if mp_launch else d.engine_args
    if d.sleep_mode:
        args = {**args, **sleep.SLEEP_ARGS}
    run_as = engine_user(model_path, d.node.model_store)
    try:  # the compile cache's folder, and the KV size of the last matching load when asked to reuse it
        warm_args, warm_env, start = warmstart.launch_prepare(d, model_path, run_as)
    except warmstart.ProfileRefused as exc:
        raise PlanFailed(str(exc)) from exc
    d.load_detail = {**(d.load_detail or {}), "start": start}  # LoadWatch keeps it and records it with the load
    Deployment.objects.filter(pk=d.pk).update(load_detail=d.load_detail)
    argv = serveargv.build_argv(vllm_bin, model_path, d.port, serveargv.API_HOST, {**args, **warm_args},
                                media.engine_args(d, flags))
    engineapikey.new(d)  # a new key for every engine started (_engine_env hands it over)
    # Started in the model's folder: a relative file flag (--chat-template t.jinja) reads from there. With Ray the
    # engine carries the marker its Ray head got (raycluster.head_start); a persisted one starts under its unit
    # again, enabled for the next boot.
    spec = lifecycle.Launch(argv=argv, env={**_engine_env(d), **warm_env}, log_path=_log_path(d), cwd=Path(model_path),
                            run_as=run_as, marker=d.marker if ray else "")
    lifecycle.launch(d, spec, unit_install=lambda argv, env, log_path, cwd: unit_install(d, argv, env, log_path, cwd=cwd))
    return f"PID {d.pid}: {' '.join(argv[:3])} … (log {d.log_path})"


def _engine_env(d: Deployment) -> dict[str, str]:
    """The engine's environment, without the marker (lifecycle.launch sets it); its key set last (engineapikey),
    so no deployment variable replaces it. A single-node engine talks over loopback only (processenv.LOOPBACK_ONLY)."""
    own = cluster.rank_env(d, cluster.head_address(d), d.gpu_indices) if d.master_port else {
        **processenv.deployment_env(d.env, d.gpu_indices), **processenv.LOOPBACK_ONLY,
        **(sleep.SLEEP_ENV if d.sleep_mode else {})}
    if raycluster.uses_ray(d):
        own.update(raycluster.engine_env(d))
    return {**own, **engineapikey.env(_key(d))}


def _key(d: Deployment) -> str:
    """The engine's key as this plan stored it, or PlanFailed when this node cannot open it."""
    try:
        return engineapikey.of(d)
    except engineapikey.KeyUnreadable as exc:
        raise PlanFailed(str(exc)) from exc


def _unit(d: Deployment, argv: list[str]) -> tuple[str, dict[str, str]]:
    """The head's unit text and its secret variables (a 0600 EnvironmentFile, not the unit text)."""
    return unit_text(d, argv, lifecycle.marked_env(_engine_env(d), d.marker), d.log_path)


def _claim(d: Deployment) -> None:
    """Last check before an engine starts, under the node lock every claiming path takes: no other
    active deployment holds these GPUs (the whole host on a node without GPUs)."""
    clash = claims.first_clash(d.node, d.gpu_indices, exclude=d, spare={o.pk for o in sleep.sharing(d)})
    if clash:
        raise PlanFailed(f"{clash.name} ({clash.get_status_display().lower()}) holds "
                         f"{'GPUs ' + ', '.join(map(str, d.gpu_indices)) if d.gpu_indices else 'this host'}.")


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


def _follow(d: Deployment, fresh: bool = True) -> None:
    """Follow the log and GPU memory until /health answers; stalled only when both stop moving.
    fresh=False: a load the agent follows again after a restart (its timings are not learnt from)."""
    follow = lifecycle.LogFollow(d)
    progress = follow.progress
    watch = loads.LoadWatch(d, fresh)  # phases, prediction, read rate
    memory = _gpu_memory(d.gpu_indices)
    moved_at = time.monotonic()
    saved_at = 0.0
    base_url = f"http://127.0.0.1:{d.port}"
    with step(d, "load") as event:
        watch.event_id = event.pk
        while True:
            watch.read(follow)
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
                if d.master_port:  # every node's load side by side; a failed worker rank fails the plan
                    d.load_detail["nodes"] = ranks.ranks_progress(d)
                    cluster.ranks_failed(d)
                    if raycluster.uses_ray(d) and not raycluster.head_alive(d):
                        raise PlanFailed(f"The Ray head on {d.node} exited while the engine loaded.")
                d.log_tail = follow.tail
                Deployment.objects.filter(pk=d.pk).update(load_phase=d.load_phase, load_percent=d.load_percent,
                                                          load_detail=d.load_detail, log_tail=d.log_tail)
                record_shm(d)
                payloads.send_deployment_status(d)
                if stop_requested(d):
                    raise Aborted("stop requested")
            if why := follow.exited():  # with its cause and fix where the log names a known one
                cause = startcauses.advise(follow.lines, d.engine_args)
                raise StartFailed(f"The engine exited while loading: {why}" + (f" {cause.describe()}" if cause else ""),
                                  cause)
            if vllm.health(base_url, timeout=1.0):
                _answered_by_ours(d, base_url)
                watch.read(follow)  # what was written since the last read: "API up" among it
                break
            if idle := progress.stalled(now, moved_at, d.stall_seconds):
                raise PlanFailed(f"Stalled: neither the log nor GPU memory moved for {idle:.0f} s "
                                 f"(phase {progress.phase}, {progress.percent} %).")
            time.sleep(HEALTH_POLL_S)
        took = (timezone.now() - d.started).total_seconds() if d.started else 0
        event.message = f"Ready after {took:.0f} s" + (f" (weights {progress.weights_seconds:.0f} s)" if progress.weights_seconds else "") + "."
        if changes := watch.ready():
            event.message += f" {changes[0].upper()}{changes[1:]}."
    d.load_phase, d.load_percent = "server_up", 100.0
    d.log_tail = follow.tail
    move(d, S.READY)
    _smoke(d, base_url, _key(d))
    watch.finish()


def _answered_by_ours(d: Deployment, base_url: str) -> None:
    """The server answering /health on the deployment's port is its engine, or PlanFailed naming who it is: a
    stranger that took the port between the port check and the engine's bind would otherwise be taken for the
    engine. Proven by the listener's PID (the engine's marker on it or an ancestor, or its unit), or, where that
    PID cannot be read (another user's socket, an agent that is not root), by the engine's own key."""
    pids, hidden = listeners.listening(d.port)
    unit = lifecycle.unit_of(d)
    marked = {d.marker: (d.pid, d.pid_create_time)} if d.marker else {}
    strangers = [pid for pid in sorted(pids) if not ownership.owner(pid, marked, {unit} if unit else frozenset())]
    if strangers:
        who = ownership.describe(strangers[0])
        raise PlanFailed(f"Port {d.port} is answered by another process, not this deployment's engine: PID {who['pid']} "
                         f"({who['user']}: {who['command']}). Choose another port or stop that process.")
    if pids and not hidden:
        return
    try:
        vllm.served_models(base_url, timeout=5.0, key=_key(d))
    except vllm.VllmError as exc:
        raise PlanFailed(f"Port {d.port} answers /health but not with this deployment's engine key ({exc}): another "
                         "server holds the port. Choose another port or stop that server.") from exc


SMOKE_RETRY_S = 2.0


def _ask_smoke(d: Deployment, base_url: str, key: str = "") -> vllm.SmokeResult:
    """The smoke test's answer, asked again after a timeout or a 5xx until settings.SMOKE_BOUND_S has passed;
    a 4xx (our request is wrong) is the answer at once. `key`: the engine's (engineapikey)."""
    deadline = time.monotonic() + settings.SMOKE_BOUND_S
    while True:
        try:
            name = d.served_model_name or (vllm.served_models(base_url, key=key) or [""])[0]
            return vllm.smoke_test(base_url, name, timeout=max(1.0, min(60.0, deadline - time.monotonic())), key=key)
        except vllm.VllmError as exc:
            if exc.permanent or time.monotonic() + SMOKE_RETRY_S >= deadline:
                raise
            log.warning("Smoke test of %s will be asked again: %s", d.name, exc)
            time.sleep(SMOKE_RETRY_S)


def _smoke(d: Deployment, base_url: str, key: str) -> None:
    with step(d, "smoke_test") as event:
        try:
            result = _ask_smoke(d, base_url, key)
        except vllm.VllmError as exc:
            event.level = DeploymentEvent.Level.WARNING
            event.message = f"The engine is up but the smoke test failed: {exc}"
            return
        d.smoke = asdict(result)
        Deployment.objects.filter(pk=d.pk).update(smoke=d.smoke)
        event.message = (f"{result.reply.strip()[:200]!r} in {result.latency_s:.2f} s, "
                         f"{result.completion_tokens} tokens" + (f" ({result.reasoning_tokens} reasoning)" if result.reasoning_tokens else ""))
    payloads.send_deployment_status(d)


def _log_path(d: Deployment) -> Path:
    return Path(settings.VAR_DIR) / "logs" / f"{d.name}-{d.pk}-{int(time.time())}.log"
