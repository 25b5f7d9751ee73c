"""Sleep mode on the node: a deployment put to sleep and woken on its GPUs, and a swap from the deployment that
serves to one that sleeps (or is stopped) on the same GPUs, each step timed on both timelines.

vLLM's sleep mode (an engine started with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1): level 1 moves the
weights to host RAM and drops the KV cache, level 2 drops the weights too and keeps the initialised engine, so a
wake skips process start, compile and profiling. The level is chosen from the host's free RAM against the
weights (a margin kept), and said on the timeline. A sleeping engine keeps its CUDA context and allocator
reserve on each GPU (SLEEP_RESIDUAL_BYTES); its GPUs are released when what its processes hold falls below that.
"""
import logging
import time


from deployments import claims
from deployments.gateway import changes
from deployments.gateway.models import Route
from deployments.host import processes, vllm
from deployments.models import Deployment
from deployments.node import lifecycle
from deployments.node import sleepprobe
from deployments.node.guards import foreign_holders
from deployments.node.sleepprobe import SLEEP_TIMEOUT_S, WAKE_TIMEOUT_S, group_rss
from deployments.node.steps import Aborted, PlanFailed, move, step
from deployments.timeline import deployment_event

log = logging.getLogger(__name__)
S = Deployment.Status
GIB = sleepprobe.GIB
_base, _key, _held_text = sleepprobe.base, sleepprobe.key, sleepprobe.held_text


def _wait_gpu(d: Deployment, released: bool, timeout_s: float) -> dict[int, int]:
    """Until NVML shows the engine's memory released or taken again; PlanFailed with the last reading if not."""
    held, settled = sleepprobe.settle(d, released, timeout_s)
    if not settled:
        raise PlanFailed(f"GPU memory was not {'released' if released else 'taken again'} within {timeout_s:.0f} s: "
                         + _held_text(held))
    return held


def put_to_sleep(d: Deployment, level: int | None = None) -> str:
    """Sleep a ready deployment (the level chosen when none is given) and wait for its GPU memory; a timeline
    step on it. Returns what happened."""
    if d.status != S.READY:
        raise PlanFailed(f"{d.name} is {d.get_status_display().lower()}, not ready: it cannot be put to sleep.")
    if not d.sleep_mode:
        raise PlanFailed(f"{d.name} was not started with sleep mode: stop it instead, or redeploy it with sleep mode.")
    level, why = sleepprobe.trusted_level(d, level)  # the probe runs first when this combination never was
    with step(d, "sleep") as event:
        started = time.monotonic()
        vllm.sleep(_base(d), level, key=_key(d), timeout=SLEEP_TIMEOUT_S)
        asked = time.monotonic() - started
        held = _wait_gpu(d, released=True, timeout_s=SLEEP_TIMEOUT_S)
        ram = group_rss(d)
        d.sleep_level, d.sleep_ram_bytes = level, ram
        Deployment.objects.filter(pk=d.pk).update(sleep_level=level, sleep_ram_bytes=ram)
        took = time.monotonic() - started
        event.message = (f"Asleep at {why}, in {took:.2f} s (the engine's sleep call {asked:.2f} s); GPU memory "
                         f"now {_held_text(held)}; host RAM {ram / GIB:.2f} GiB.")
        event.data = {"seconds": round(took, 3), "engine_s": round(asked, 3), "level": level, "ram_bytes": ram}
    move(d, S.SLEEPING, f"Asleep at {why}.")  # once the step has ended: whoever sees the status finds it done
    return event.message


def wake_blockers(d: Deployment) -> list[str]:
    """Who holds the GPUs a sleeping deployment would wake on: another of the panel's deployments that is not
    asleep, or a process the panel did not start. Empty: it may wake."""
    awake = claims.awake_holders(d.node, d.gpu_indices, exclude=d)
    named = [f"{o.name} ({o.get_status_display().lower()})" for o in awake]
    named += [f"PID {p['pid']} ({p['user']}: {p['command'][:80]})" for p in
              foreign_holders(d.node_id, d.gpu_indices, spare=[d.pk]) if not p["display"]]
    return named


def wake(d: Deployment) -> str:
    """Wake a sleeping deployment, refused (PlanFailed) while another engine holds its GPUs; a timeline step."""
    if d.status != S.SLEEPING:
        raise PlanFailed(f"{d.name} is {d.get_status_display().lower()}, not asleep.")
    if blockers := wake_blockers(d):
        raise PlanFailed(f"{d.name} cannot wake: its GPUs are held by {'; '.join(blockers)}.")
    with step(d, "wake") as event:
        started = time.monotonic()
        sleepprobe.engine_wake(d, d.sleep_level)
        asked = time.monotonic() - started
        held = _wait_gpu(d, released=False, timeout_s=WAKE_TIMEOUT_S)
        level = d.sleep_level
        d.sleep_level = d.sleep_ram_bytes = None
        Deployment.objects.filter(pk=d.pk).update(sleep_level=None, sleep_ram_bytes=None)
        took = time.monotonic() - started
        event.message = (f"Awake in {took:.2f} s from level {level} (the engine's wake call {asked:.2f} s); "
                         f"GPU memory {_held_text(held)}.")
        event.data = {"seconds": round(took, 3), "engine_s": round(asked, 3), "level": level, "start": "wake"}
    move(d, S.READY, "")  # once the step has ended: whoever sees the status finds it done
    return event.message


def move_aliases(source: Deployment, target: Deployment) -> list[str]:
    """The gateway names callers use for `source` (its route's aliases) now lead to `target`; the names moved."""
    route = Route.objects.filter(deployment=source).first()
    names = [n for n in (route.names if route else []) if isinstance(n, str) and n]
    if not names:
        return []
    other, _ = Route.objects.get_or_create(deployment=target)
    other.names = list(dict.fromkeys([*other.names, *names]))
    other.save(update_fields=["names"])
    route.names = []
    route.save(update_fields=["names"])
    changes.changed("routes")
    return names


# --- the node's tasks --------------------------------------------------------------------------------------

def _run(deployment_id: int, action, *args) -> None:
    with lifecycle.driving(deployment_id):
        d = Deployment.objects.select_related("model", "node").get(pk=deployment_id)
        try:
            action(d, *args)
        except (PlanFailed, vllm.VllmError) as exc:
            deployment_event(d, action.__name__.strip("_"), f"Not done: {exc}", level="error")
        except Aborted:
            log.info("deployment %s: %s interrupted by a stop", d.name, action.__name__)


def deployment_sleep_here(deployment_id: int, level: int | None = None) -> None:
    _run(deployment_id, put_to_sleep, level)


def deployment_sleep_probe_here(deployment_id: int) -> None:
    _run(deployment_id, sleepprobe.run)  # its own step on the timeline says how it went


def deployment_wake_here(deployment_id: int) -> None:
    _run(deployment_id, wake)


def deployment_swap_here(source_id: int, target_id: int) -> None:
    """Swap the serving `source` for `target` (asleep: woken; stopped: the caller queued its plan instead)."""
    with lifecycle.driving(source_id), lifecycle.driving(target_id):
        source = Deployment.objects.select_related("model", "node").get(pk=source_id)
        target = Deployment.objects.select_related("model", "node").get(pk=target_id)
        started = time.monotonic()
        try:
            if source.status == S.READY:
                put_to_sleep(source)
            wake(target)
        except (PlanFailed, vllm.VllmError) as exc:
            deployment_event(target, "swap", f"Swap from {source.name} not done: {exc}", level="error")
            if source.status == S.SLEEPING and target.status != S.READY:
                _rewake(source)
            return
        except Aborted:
            return
        names = move_aliases(source, target)
        took = time.monotonic() - started
        said = f"Swapped from {source.name} in {took:.2f} s" + (f"; the names {', '.join(names)} moved here" if names else "")
        deployment_event(target, "swap", said + ".", seconds=round(took, 3))
        deployment_event(source, "swap", f"Swapped to {target.name} in {took:.2f} s.", seconds=round(took, 3))


def _rewake(d: Deployment) -> None:
    """A swap whose target could not wake: the source serves again rather than leaving nothing serving."""
    try:
        wake(d)
    except (PlanFailed, vllm.VllmError, Aborted) as exc:
        deployment_event(d, "wake", f"Not woken again after the failed swap: {exc}", level="error")


def reconcile_sleep(d: Deployment) -> None:
    """After an agent restart, an engine that is up reads as it truly is: asleep or serving (a swap interrupted
    between its steps leaves one of the two, never a row that says otherwise)."""
    if not d.sleep_mode or d.status not in Deployment.UP:
        return
    try:
        asleep = vllm.is_sleeping(_base(d), key=_key(d), timeout=5.0)
    except (vllm.VllmError, PlanFailed):
        return
    if asleep and d.status == S.READY:
        move(d, S.SLEEPING, "Found asleep after the agent restarted.")
        deployment_event(d, "adopted", "The engine is asleep (found after an agent restart).")
    elif not asleep and d.status == S.SLEEPING:
        Deployment.objects.filter(pk=d.pk).update(sleep_level=None, sleep_ram_bytes=None)
        move(d, S.READY, "")
        deployment_event(d, "adopted", "The engine is awake (found after an agent restart).")


# --- what the deploy plan asks ------------------------------------------------------------------------------

SLEEP_ARGS = {"enable-sleep-mode": True}
SLEEP_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM serves /sleep, /wake_up, /is_sleeping only with it


def sharing(d: Deployment) -> list[Deployment]:
    """The loaded sleep-mode deployments on a sleep-mode deployment's GPUs: put to sleep, not stopped."""
    if not d.sleep_mode:
        return []
    return list(claims.sleep_sharers(d.node, d.gpu_indices, exclude=d).select_related("model", "node"))


def sharing_pids(d: Deployment) -> set[int]:
    """Processes of the deployments sharing its GPUs asleep: what they keep there is not waited for."""
    return {pid for o in sharing(d) if o.pgid for pid in processes.members(o.pgid)}


def make_way(d: Deployment) -> tuple[str, list[int]]:
    """Put the serving deployments that share its GPUs to sleep (each on its own timeline); (what was done,
    their ids, to wake again when this one starts asleep)."""
    slept, said = [], []
    for other in sharing(d):
        if other.status == S.READY:
            with lifecycle.driving(other.pk):
                put_to_sleep(other)
            slept.append(other.pk)
            said.append(f"{other.name} put to sleep (level {other.sleep_level})")
        else:
            said.append(f"{other.name} asleep already")
    return "; ".join(said), slept


def after_load(d: Deployment, slept: list[int], swap_from: int | None) -> None:
    """Once loaded and smoke-tested: a swap's target takes the names of the one it replaced; one started asleep
    goes to sleep, and those this plan put to sleep wake again."""
    if swap_from and (source := Deployment.objects.filter(pk=swap_from).first()):
        names = move_aliases(source, d)
        deployment_event(d, "swap", f"Swapped from {source.name}" + (f"; the names {', '.join(names)} moved here."
                                                                      if names else "."))
        return
    if not d.start_asleep:
        return
    put_to_sleep(d)
    for other in Deployment.objects.filter(pk__in=slept).select_related("model", "node"):
        with lifecycle.driving(other.pk):
            try:
                wake(other)
            except (PlanFailed, vllm.VllmError) as exc:
                deployment_event(other, "wake", f"Not woken again after {d.name} loaded: {exc}", level="error")
