"""Sleep mode proven before it is trusted, and the engine's sleep calls and memory readings the node's sleep, wake
and swap share (deployments/node/sleep.py).

vLLM's sleep mode is not trustworthy everywhere: in 0.14-0.15 a sleep freed almost nothing, it leaks memory with
--mm-encoder-tp-mode data (the Kimi-K2.5 recipe's flag), and runs out of memory on NVFP4 on Blackwell workstation
GPUs. A probe puts a ready engine to sleep at each level and wakes it, and records for each: seconds to sleep and to
wake, the GPU memory its processes hold before, asleep and after on each GPU (from NVML, never the engine's word),
the host RAM it took asleep, and whether a fixed prompt at temperature 0 answers the same after the wake. A level
passes when its memory went (below what a sleeping engine keeps: its CUDA context and allocator reserve), came back
within a margin, and the answer is identical. Level 1 is tried only when the host's free RAM holds the weights.
"""
import logging
import os
import time

import psutil
from django.utils import timezone

from deployments import engineapikey
from deployments.host import gpu, processes, vllm
from deployments.models import Deployment, SleepProbe
from deployments.node.steps import PlanFailed, step

log = logging.getLogger(__name__)
GIB = 1 << 30
MIB = 1 << 20
RAM_MARGIN = 1.1          # level 1 needs the weights x this in free host RAM ...
RAM_SPARE = 4 * GIB       # ... and this much left besides
SLEEP_RESIDUAL_BYTES = int(os.environ.get("PANEL_SLEEP_RESIDUAL_MIB", "2048")) << 20
SLEEP_TIMEOUT_S = float(os.environ.get("PANEL_SLEEP_TIMEOUT_S", "300"))
WAKE_TIMEOUT_S = float(os.environ.get("PANEL_WAKE_TIMEOUT_S", "900"))
SETTLE_S = float(os.environ.get("PANEL_SLEEP_PROBE_SETTLE_S", "30"))  # memory going or coming back, at most
BACK_SHARE, BACK_BYTES = 0.05, 512 * MIB  # memory after a wake: within 5 % of before, or 512 MiB, whichever is more
PROMPT = "List the first ten prime numbers, separated by commas."
ANSWER_TOKENS = 32
V = SleepProbe.Verdict


def choose_level(weights_bytes: int, available_bytes: int) -> tuple[int, str]:
    """(level, why): 1 when the host's free RAM holds the weights with a margin, else 2."""
    need = int(weights_bytes * RAM_MARGIN) + RAM_SPARE
    if weights_bytes and available_bytes >= need:
        return 1, (f"level 1: its {weights_bytes / GIB:.1f} GiB of weights go to host RAM "
                   f"({available_bytes / GIB:.1f} GiB free)")
    return 2, (f"level 2: {weights_bytes / GIB:.1f} GiB of weights do not fit in the host's "
               f"{available_bytes / GIB:.1f} GiB of free RAM with {RAM_SPARE / GIB:.0f} GiB to spare; "
               "they are dropped and read again at wake")


def base(d: Deployment) -> str:
    return f"http://127.0.0.1:{d.port}"


def key(d: Deployment) -> str:
    try:
        return engineapikey.of(d)
    except engineapikey.KeyUnreadable as exc:
        raise PlanFailed(str(exc)) from exc


def group_rss(d: Deployment) -> int:
    """Host RAM the engine's process group holds (resident set, summed)."""
    total = 0
    for pid in processes.members(d.pgid) if d.pgid else []:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total


def gpu_held(d: Deployment) -> dict[int, int]:
    """Bytes the engine's processes hold on each of its GPUs ({} without NVML or GPUs)."""
    if not d.gpu_indices or not d.pgid:
        return {}
    pids = set(processes.members(d.pgid))
    try:
        by_gpu = gpu.processes_on(d.gpu_indices)
    except gpu.NvmlUnavailable:
        return {}
    return {i: sum(p.used_memory or 0 for p in procs if p.pid in pids) for i, procs in by_gpu.items()}


def held_text(held: dict) -> str:
    return ", ".join(f"GPU {i} {b / GIB:.2f} GiB" for i, b in sorted(held.items())) if held else "no GPU to read"


def settle(d: Deployment, released: bool, timeout_s: float) -> tuple[dict[int, int], bool]:
    """Until NVML shows the engine's memory released (below the residual a sleeping engine keeps) or, for a wake,
    taken again: (the last reading, whether it got there within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = gpu_held(d)
        if not held or all((b <= SLEEP_RESIDUAL_BYTES) == released for b in held.values()):
            return held, True
        if time.monotonic() >= deadline:
            return held, False
        time.sleep(0.1)


def engine_wake(d: Deployment, level: int | None) -> None:
    """The engine's wake calls: after a level 2 sleep the weights come back uninitialised and are read again
    before the KV cache wakes."""
    if level == 2:
        vllm.wake_up(base(d), tags=("weights",), key=key(d), timeout=WAKE_TIMEOUT_S)
        vllm.reload_weights(base(d), key=key(d), timeout=WAKE_TIMEOUT_S)
    vllm.wake_up(base(d), key=key(d), timeout=WAKE_TIMEOUT_S)
    if vllm.is_sleeping(base(d), key=key(d)):
        raise PlanFailed("The engine answered the wake call but says it is still asleep.")


def judge(before: dict, asleep: dict, after: dict, same: bool) -> list[str]:
    """What is wrong with one level's figures (bytes per GPU index): nothing, or each problem with its figure."""
    problems = []
    for i, b in sorted(asleep.items()):
        if b > SLEEP_RESIDUAL_BYTES:
            problems.append(f"GPU {i} still held {b / GIB:.2f} GiB asleep (at most {SLEEP_RESIDUAL_BYTES / GIB:.2f} "
                            f"GiB may stay; {before.get(i, 0) / GIB:.2f} GiB before)")
    for i, b in sorted(before.items()):
        back = after.get(i, 0)
        if abs(back - b) > max(BACK_SHARE * b, BACK_BYTES):
            problems.append(f"GPU {i} held {back / GIB:.2f} GiB after the wake against {b / GIB:.2f} GiB before")
    if not same:
        problems.append("the answer to the fixed prompt at temperature 0 changed after the wake")
    return problems


def _answer(d: Deployment) -> str:
    name = d.served_model_name or (vllm.served_models(base(d), key=key(d)) or [""])[0]
    return vllm.smoke_test(base(d), name, PROMPT, timeout=120.0, max_tokens=ANSWER_TOKENS, key=key(d),
                           temperature=0).reply


def _level(d: Deployment, level: int, expected: str) -> dict:
    """Sleep at `level`, wake, and read everything the verdict needs."""
    before, ram_before = gpu_held(d), group_rss(d)
    started = time.monotonic()
    vllm.sleep(base(d), level, key=key(d), timeout=SLEEP_TIMEOUT_S, mode="wait")  # requests in flight finish
    asleep, _ = settle(d, released=True, timeout_s=SETTLE_S)
    sleep_s, ram_asleep = time.monotonic() - started, group_rss(d)
    started = time.monotonic()
    engine_wake(d, level)
    after, _ = settle(d, released=False, timeout_s=SETTLE_S)
    wake_s = time.monotonic() - started
    answer = _answer(d)
    problems = judge(before, asleep, after, answer == expected)
    return {"level": level, "tried": True, "passed": not problems, "problems": problems,
            "sleep_s": round(sleep_s, 3), "wake_s": round(wake_s, 3),
            "gpu_before": _bytes(before), "gpu_asleep": _bytes(asleep), "gpu_after": _bytes(after),
            "ram_taken_bytes": max(0, ram_asleep - ram_before), "answer_same": answer == expected,
            "answer": answer[:200]}


def _bytes(held: dict) -> dict[str, int]:
    return {str(i): int(b) for i, b in sorted(held.items())}


def run(d: Deployment) -> SleepProbe:
    """Probe a ready sleep-mode deployment's sleep on its timeline; the probe, passed or failed (PlanFailed only when
    the deployment cannot be probed at all)."""
    if d.status != Deployment.Status.READY or not d.sleep_mode:
        raise PlanFailed(f"{d.name} must be ready and started with sleep mode to probe its sleep.")
    probe = SleepProbe.objects.create(node=d.node, model=d.model, deployment=d, key=SleepProbe.key_of(d),
                                      combination=SleepProbe.combination_of(d))
    with step(d, "sleep_probe") as event:
        try:
            expected = _answer(d)
            weights = d.model.total_size or 0
            fits, why = choose_level(weights, psutil.virtual_memory().available)
            for level in (1, 2):
                if level == 1 and fits != 1:
                    probe.levels.append({"level": 1, "tried": False, "passed": False, "why": why})
                    continue
                probe.levels.append(_level(d, level, expected))
            tried = [r for r in probe.levels if r["tried"]]
            probe.verdict = V.PASSED if all(r["passed"] for r in tried) else V.FAILED
        except (vllm.VllmError, PlanFailed) as exc:
            probe.verdict, probe.reason = V.FAILED, f"The probe could not finish: {exc}"
            _rewake(d)
        text = probe.summary()
        probe.reason = probe.reason or (text if probe.verdict == V.FAILED else "")
        probe.ended = timezone.now()
        probe.save()
        event.message = f"Sleep probe {probe.verdict}: " + (probe.reason if probe.reason.startswith("The probe") else text)
        event.data = {"probe": probe.pk, "verdict": probe.verdict}
        if probe.verdict == V.FAILED:
            event.level = event.Level.WARNING
    return probe


def _rewake(d: Deployment) -> None:
    """A probe that failed halfway leaves the engine serving if it can."""
    try:
        if vllm.is_sleeping(base(d), key=key(d)):
            engine_wake(d, 2)
    except (vllm.VllmError, PlanFailed) as exc:
        log.warning("deployment %s: not woken after its sleep probe failed: %s", d.name, exc)


def trusted_level(d: Deployment, level: int | None) -> tuple[int, str]:
    """The level a sleep may use, with why: probed first when this combination never was (once, on its timeline);
    PlanFailed with the probe's figures when it failed or the asked level did not pass."""
    probe = SleepProbe.latest_for(d) or run(d)
    if probe.verdict != V.PASSED:
        raise PlanFailed(f"Sleep refused: the sleep probe of {probe.created:%Y-%m-%d %H:%M} failed for this model, "
                         f"engine, memory flags and GPUs. {probe.reason}")
    passed = probe.passed_levels()
    if level is not None:
        if level not in passed:
            raise PlanFailed(f"Sleep refused: level {level} was not proven by the sleep probe ({probe.summary()})")
        return level, f"level {level}: as asked"
    chosen, why = choose_level(d.model.total_size or 0, psutil.virtual_memory().available)
    if chosen in passed:
        return chosen, why
    if 2 in passed:
        return 2, why if chosen == 2 else "level 2: the only level the sleep probe proved"
    raise PlanFailed(f"Sleep refused: {why}, and the sleep probe proved only level 1 ({probe.summary()})")
