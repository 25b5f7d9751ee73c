"""Benchmark runs: create (validated, with an environment snapshot), execute next to the engine,
cancel, and compare. The load generator itself is benchmarks/runner (no Django)."""
import shlex
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from benchmarks import allowlist, caps, energy, payloads, runner, runqueue, runrepeats, selectors
from benchmarks.runner.saturation import queue_note
from benchmarks.runner import capacity as capacity_search, slo as slos_mod
from benchmarks.models import BenchmarkPoint, BenchmarkRun
from deployments import engineapikey, secrets
from deployments.host import gpu, processes, vllm
from deployments.models import Deployment, ModelCopy
from deployments.selectors import deployment_startup
from deployments.node.lifecycle import running as engine_running
from plumbing.errors import ServiceError
from plumbing.queue import enqueue

S = BenchmarkRun.Status
# The LoadSpec fields a run's params may set (levels apart); their defaults are LoadSpec's.
SPEC_PARAMS = ("endpoint", "prompt_source", "prompts", "input_tokens", "max_tokens", "ignore_eos", "temperature", "seed",
               "min_requests", "requests_per_user", "warmup_per_user", "stop_when_saturated", "workload",
               "request_timeout_s", "repeats")
# Open-loop levels: kept in a run's params only when it asks for rates.
RATE_PARAMS = ("rates", "arrival", "burstiness", "max_concurrency", "ramp", "ramp_from", "rate_duration_s")
# SLOs (runner/slo.py) and a capacity search (runner/capacity.py): kept in params when asked for.
SLO_PARAMS = ("slos", "capacity")
DEFAULTS = {"levels": list(runner.DEFAULT_LEVELS),
            **{k: runner.spec_default(k) for k in SPEC_PARAMS if k not in ("prompts", "workload")}}
TICK_KEEP = 20_000  # points of the tok/s-over-time chart kept per run
CANCEL_CHECK_S = 0.5


@dataclass
class RunTarget:
    """Where the load goes and who sends it: the node next to the engine, or the control worker."""

    base_url: str
    model: str
    queue: str


def run_target(run: BenchmarkRun) -> RunTarget:
    if run.deployment_id:
        d = run.deployment
        # The node's agent runs the load next to the engine, on loopback.
        return RunTarget(f"http://127.0.0.1:{d.port}", run.served_model, d.node.queue)
    return RunTarget(run.base_url, run.served_model, "control")


def environment_of(d: Deployment) -> dict:
    """What the numbers depend on: model, engine and its flags, environment, GPUs, node."""
    copy = ModelCopy.objects.filter(model=d.model, node=d.node).first()
    return {
        "deployment": d.name, "model": str(d.model), "model_commit": d.model.commit, "node": d.node.name,
        "engine_version": d.node.engine_version, "engine_args": secrets.mask(d.engine_args), "env": secrets.mask(d.env, secrets.marked(d)),
        "gpus": [{"index": g.index, "name": g.name, "memory_total": g.memory_total} for g in d.gpus.all()],
        "model_path": copy.path if copy else "",
        "startup": deployment_startup(d),  # seconds per start-up phase of its latest load
    }


def engine_command(d: Deployment | None) -> str:
    """The command line of the engine the run measures, read from the running process on this node
    (what ran, not what the row says), secrets redacted; "" when there is none provably ours here."""
    if d is None or not engine_running(d):
        return ""
    return secrets.redact_deployment(d, shlex.join(processes.command_line(d.pid)))


def _warnings(params: dict, d: Deployment | None) -> list[str]:
    warnings = []
    if d and d.engine_args.get("max-num-seqs"):
        limit = int(d.engine_args["max-num-seqs"])
        above = [c for c in params["levels"] if c > limit]
        if above:
            warnings.append(f"The engine's --max-num-seqs is {limit}: at concurrency {', '.join(map(str, above))} "
                            "requests queue in the engine, so those levels measure queueing too.")
    return warnings


@transaction.atomic
def run_create(*, params: dict, deployment: Deployment | None = None, base_url: str = "", served_model: str = "",
               name: str = "", user=None) -> BenchmarkRun:
    """Create a sweep and queue it: on the deployment's node, or on the control worker for a URL."""
    if bool(deployment) == bool(base_url):
        raise ServiceError("Benchmark either a deployment or a URL.", field="deployment")
    if base_url:
        allowlist.check(base_url)
    if deployment and deployment.status != Deployment.Status.READY:
        raise ServiceError(f"{deployment.name} is {deployment.get_status_display().lower()}, not ready.",
                           field="deployment", code="not_running")
    busy = BenchmarkRun.objects.filter(deployment=deployment, status__in=BenchmarkRun.ACTIVE) if deployment else None
    if busy is not None and busy.exists():
        raise ServiceError(f"Run {busy.first().pk} is already measuring {deployment.name}; wait or cancel it.",
                           field="deployment", code="busy")
    params = {**DEFAULTS, **params}
    params["levels"] = sorted({int(c) for c in params["levels"]})
    params = _slo_params(params)
    if problem := runner.timeout_problem(params["request_timeout_s"]):
        raise ServiceError(problem, field="request_timeout_s")
    if problem := runner.repeats_problem(params["repeats"]):
        raise ServiceError(problem, field="repeats")
    if params.get("rates") or params.get("capacity"):
        params = {**{k: runner.spec_default(k) for k in RATE_PARAMS}, **params}
        params["rates"] = sorted({float(r) for r in params["rates"]})
    else:
        params = {k: v for k, v in params.items() if k not in RATE_PARAMS}
    caps.check(params, deployment)
    run = BenchmarkRun.objects.create(
        name=name or f"{deployment.name if deployment else base_url} {timezone.now():%Y-%m-%d %H:%M:%S}",
        deployment=deployment, base_url=base_url, params=params, created_by=user,
        served_model=served_model or (deployment.served_model_name if deployment else ""),
        environment=environment_of(deployment) if deployment else {"base_url": base_url, "model": served_model},
        warnings=_warnings(params, deployment))
    target = run_target(run)
    enqueue("benchmarks.run_execute", args=[run.pk], queue=target.queue)
    return run


def _slo_params(params: dict) -> dict:
    """SLOs and a capacity search checked and normalised; absent when not asked for. ServiceError names the field."""
    params = {k: v for k, v in params.items() if k not in SLO_PARAMS or v}
    try:
        if params.get("slos"):
            params["slos"] = slos_mod.validate(params["slos"])
    except runner.RunnerError as exc:
        raise ServiceError(exc.message, field="slos") from exc
    if params.get("capacity"):
        if not params.get("slos"):
            raise ServiceError("A capacity search needs SLOs to meet, e.g. ttft:p99:2s.", field="slos")
        try:
            params["capacity"] = capacity_search.check(params["capacity"])
        except runner.RunnerError as exc:
            raise ServiceError(exc.message, field="capacity") from exc
    return params


def capacity_subject(run: BenchmarkRun) -> str:
    """Who the capacity sentence is about: the deployment by name, or the server at the run's URL."""
    return run.deployment.name if run.deployment_id else f"The server at {run.base_url}"


def run_cancel(run: BenchmarkRun) -> BenchmarkRun:
    """Stop a run: finished levels stay; a queued run never starts."""
    with transaction.atomic():
        run = BenchmarkRun.objects.select_for_update().get(pk=run.pk)
        if run.status not in BenchmarkRun.ACTIVE:
            raise ServiceError(f"Run {run.pk} is {run.get_status_display().lower()}.", code="not_running")
        run.cancel_requested = True
        if run.status == S.QUEUED:
            run.transition(S.CANCELLED)
        run.save()
    payloads.send_run_status(run)
    return run


def run_abandon(run: BenchmarkRun, reason: str) -> BenchmarkRun:
    """Mark a run failed whose measuring process is gone (its node agent was killed): nothing will end it."""
    with transaction.atomic():
        run = BenchmarkRun.objects.select_for_update().get(pk=run.pk)
        if run.status not in BenchmarkRun.ACTIVE:
            return run
        if run.status == S.QUEUED:
            run.transition(S.RUNNING)
        run.transition(S.FAILED, error=reason, cancel_requested=True)
        run.save()
    payloads.send_run_status(run)
    return run


def _save_point(run: BenchmarkRun, level: runner.LevelResult, energy_j: float | None = None,
                gpus: int = 0) -> BenchmarkPoint:
    values = level.to_dict()
    values["goodput"] = round(level.slo["goodput"], 4) if level.slo else None
    if energy_j is not None and gpus and level.duration_s > 0:
        values.update(energy_j=round(energy_j, 3), watts_per_gpu=round(energy_j / level.duration_s / gpus, 1))
        if (net := energy.net_joules(energy_j, run.idle_watts, level.duration_s)) is not None:
            values["energy_net_j"] = round(net, 3)
    fields = {f.name for f in BenchmarkPoint._meta.get_fields()} - {"id", "run", "created"}
    point, _ = BenchmarkPoint.objects.update_or_create(
        run=run, kind=level.kind, rate=level.rate, concurrency=level.concurrency, repeat=level.repeat, defaults={k: v for k, v in values.items() if k in fields})
    payloads.send_run_point(run.pk, point)
    if note := queue_note(level, selectors.max_num_seqs(run)):
        run.warnings.append(note)
    return point


def run_execute(run_id: int) -> BenchmarkRun:
    """Run the sweep where the task landed; each level's point and the tok/s ticks go live."""
    run = BenchmarkRun.objects.select_related("deployment", "deployment__node").get(pk=run_id)
    if not runqueue.run_claim(run):  # not queued any more, or a re-driven copy of this task took it
        return run
    target = run_target(run)
    if command := engine_command(run.deployment):
        run.environment = {**run.environment, "engine_command": command}
    run.save()
    payloads.send_run_status(run)
    started = time.monotonic()
    state = {"checked": 0.0, "cancel": False, "saved": 0.0}
    # The deployment's GPUs' energy over each level (this node's: a multi-node deployment's other nodes are not
    # read), from readings at the start, every tick and each level's end.
    meter = gpu.EnergyMeter(run.deployment.gpu_indices if run.deployment_id else [])
    meter.read()

    def cancelled() -> bool:
        now = time.monotonic()
        if now - state["checked"] >= CANCEL_CHECK_S:
            state["checked"] = now
            state["cancel"] = BenchmarkRun.objects.filter(pk=run.pk, cancel_requested=True).exists()
        return state["cancel"]

    def on_tick(tick: runner.Tick) -> None:
        meter.read()
        point = [round(time.monotonic() - started, 2), tick.concurrency, round(tick.tok_s, 1)]
        run.ticks = (run.ticks + [point])[-TICK_KEEP:]
        payloads.send_run_tick(run.pk, payloads.RunTick(t=point[0], concurrency=tick.concurrency, rate=tick.rate, tok_s=tick.tok_s,
                                                in_flight=tick.in_flight, completed=tick.completed,
                                                failed=tick.failed, server=tick.server))
        if point[0] - state["saved"] >= 5:
            state["saved"] = point[0]
            BenchmarkRun.objects.filter(pk=run.pk).update(ticks=run.ticks)

    def on_level(level: runner.LevelResult) -> None:
        if level.cancelled:
            return  # a level cut short is not a measurement
        end = meter.read()  # the level ended just before its result came
        _save_point(run, level, meter.joules(end - level.duration_s, end), len(meter.indices))
        BenchmarkRun.objects.filter(pk=run.pk).update(ticks=run.ticks, warnings=run.warnings)
        payloads.send_run_status(run)

    try:
        key = _engine_key(run.deployment)
        model = target.model or _served_model(target.base_url, key)
        if model != run.served_model:
            run.served_model = model
            BenchmarkRun.objects.filter(pk=run.pk).update(served_model=model)
        if run.deployment_id:  # the GPUs' draw with the engine idle, before any request of the run
            idle, why = energy.idle_watts(meter, target.base_url, key, settings.BENCH_IDLE_S)
            run.idle_watts = round(idle, 2) if idle is not None else None
            run.warnings += [why] if why else []
            BenchmarkRun.objects.filter(pk=run.pk).update(idle_watts=run.idle_watts, warnings=run.warnings)
        # A deployment is vLLM: ask for usage in every chunk, so ITL per token divides each gap by the tokens
        # that came in it exactly (another server may refuse the option: its chunks' tokens are estimated).
        spec = runner.LoadSpec(base_url=target.base_url, model=model, **_spec_params(run.params),
                               continuous_usage_stats=bool(run.deployment_id), api_key=key,
                               tokenizer_path=run.environment.get("model_path", "") if run.deployment_id else "")
        # In a child process under a memory limit: whatever the run asks, this process and the engine
        # next to it keep their memory (benchmarks/runner/child.py).
        result = runner.sweep_in_child(spec, on_level=on_level, on_tick=on_tick, cancel=cancelled,
                                       memory_bytes=settings.BENCH_MEMORY_MB * 2**20)
        run.refresh_from_db(fields=["warnings"])
        if result.saturated:
            last = [lv for lv in result.levels if lv.kind == "concurrency"][-1]
            skipped = [c for c in run.params["levels"] if c > last.concurrency]
            run.warnings.append(f"Stopped after concurrency {last.concurrency}: the engine saturated "
                                f"({result.saturated}). Not run: {', '.join(map(str, skipped))}. "
                                "To measure every level, untick “Stop once the engine saturates” (API: stop_when_saturated "
                                "false; panelctl bench --past-saturation).")
        run.single_stream_tok_s = result.single_stream_tok_s
        if result.capacity:
            run.capacity = {**result.capacity, "text": capacity_search.text(result.capacity, capacity_subject(run))}
        run.transition(S.CANCELLED if result.cancelled else S.DONE)
    except (runner.RunnerError, ServiceError) as exc:
        run.refresh_from_db(fields=["warnings"])
        error = getattr(exc, "message", None) or str(exc)
        if isinstance(exc, runner.MemoryLimitError):
            error = (f"The benchmark ran out of memory: {error}. The engine was not affected. Ask for fewer requests "
                     "per level or shorter prompts and outputs, or raise PANEL_BENCH_MEMORY_MB on the node.")
        run.transition(S.FAILED, error=error)
    run.over_repeats = runrepeats.run_repeats(run)  # once, here: the bootstrap takes seconds a page must not wait
    run.save()
    payloads.send_run_status(run)
    return run


def _spec_params(params: dict) -> dict:
    spec = {k: params[k] for k in SPEC_PARAMS + RATE_PARAMS + SLO_PARAMS if k in params}
    spec["levels"] = tuple(params["levels"])
    spec["rates"] = tuple(params.get("rates") or ())
    return spec


def _engine_key(d: Deployment | None) -> str:
    """The key of the deployment's engine (every engine the panel starts wants it), read here on its
    node; "" for any other server."""
    if d is None:
        return ""
    try:
        return engineapikey.current(d)
    except engineapikey.KeyUnreadable as exc:
        raise ServiceError(str(exc)) from exc


def _served_model(base_url: str, key: str = "") -> str:
    try:
        models = vllm.served_models(base_url, key=key)
    except vllm.VllmError as exc:
        raise ServiceError(f"Cannot list the server's models: {exc}") from exc
    if not models:
        raise ServiceError("The server serves no model.")
    return models[0]
