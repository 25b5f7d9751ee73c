"""Are a tuning study's verdicts right, and what does the panel add per variant?

Verdicts, no engine: many small studies against three OpenAI-compatible test servers with a known
schedule (tests/schedserver.py), each request's token gap drawn from the schedule's gap ± 5 %
(uniform): "base" and "same" share a schedule, "slower" takes 5 % longer per request. Each study runs the
default 3 repeats interleaved (base same slower base same slower …) with the real load generator
(benchmarks.runner) and judges output tok/s with benchmarks.studystats, as the panel does. Twice: on the
schedules as they are, and with host drift between repeats (each repeat of each server on its schedule
times a factor drawn from N(1, --drift), as a shared host runs one trial faster than the next):

  false_significant_pct        identical variants called better or worse (target <= 5)
  detected_pct                 the true 5 % difference found, and the right way round (target >= 90)
  false_significant_drift_pct  the same with drift (target: near the interval's nominal 5)
  detected_drift_pct           the same with drift (no target: drift hides a small difference)
  repeats_mean, repeats_mean_drift   the repeats a study took: --repeats, or with --max-repeats (adaptive, as a
                               study with max_repeats runs) fewer when every variant was decided before the cap

Overhead, no engine either: the panel runs as in production (an embedded Redis, SQLite, a real node
agent) with tests/faults' fake vLLM serving through tests/schedserver.py on a known schedule (loads in
1 s, TTFT 20 ms, a token every 5 ms), and one study of a baseline and two variants × 3 repeats. The
script's own clock times the study from its creation to its end and each trial from the previous one's
end to its own; what the fake engine's load, the smoke test and the benchmark take on their schedules is
subtracted: what is left is the panel's (agent polling, the plan's steps, the runner's set-up).

  overhead_p50_s, overhead_p95_s   per trial, by this script's clock (target p95 <= 2)
  overhead_total_s                 the whole study's wall time less every schedule
  accounted_p95_s                  the panel's own accounting of the same trials (StudyTrial.overhead_s)
  estimate_first_err_pct           the study's own estimate against what it took (target within ±30), for a
                                   first study (the node knows one load and its smoke test) and the same study
  estimate_repeated_err_pct        again (it knows the first one's trials)
  estimate_after_first_trial_err_pct   the first study's elapsed time plus the time left its page shows once its
                                   first trial ended, against what it took (target within ±30)

Estimate from a run, no engine and no panel: a run of one workload (level 1, 16 tokens) against a schedule server
(TTFT 30 ms, a token every 8 ms), and the model a study's estimate makes of it for another workload (levels 1 and 2,
48 tokens; benchmarks/studyestimate.py), against the time that server's own record of the first run says the
second takes (rounds of requests, each TTFT + 47 gaps), over --estimate-rounds rounds:

  estimate_model_err_pct           the median error (target within ±30), with _min_ and _max_ beside it

    python perf/study_verdicts.py [--studies 60] [--repeats 3] [--max-repeats 8] [--drift 0.03] [--skip-overhead]
        [--estimate-rounds 10]

Last line: name=value pairs.
"""
import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from panelctl import launcher  # noqa: E402
from inprocess import start_panel, stop_engines  # noqa: E402

FAKE_VLLM = ROOT / "tests" / "faults" / "fakevllm" / "vllm"
CONCURRENCY, TOKENS, REQUESTS, GAP_MS, TTFT_MS, JITTER = 4, 24, 16, 2.0, 5.0, 0.05
# The overhead study's engine: its load, its schedule and the study's workload (all known, so subtracted).
LOAD_S, STUDY_TTFT_MS, STUDY_GAP_MS, SMOKE_TOKENS = 1.0, 20.0, 5.0, 64
STUDY_WORKLOAD = {"levels": [4], "max_tokens": 32, "requests_per_user": 2, "min_requests": 8, "warmup_per_user": 0}
STUDY_VARIANTS = [{"name": "8", "engine_args": {"max-num-seqs": 8}, "env": {}},
                  {"name": "4", "engine_args": {"max-num-seqs": 4}, "env": {}}]


def verdicts(studies: int, repeats: int, drift: float = 0.0, seed: int = 0, max_repeats: int = 0) -> dict:
    """Studies against the three servers; with `drift`, each repeat of each server runs on its schedule
    times a factor drawn from N(1, drift). With `max_repeats` above `repeats` each study is adaptive, as the panel's:
    judged after `repeats` and after every repeat more, at the sequential boundary for its looks, and stopped once
    both variants are decided (better or worse) or at `max_repeats`."""
    from benchmarks import runner, studystats
    from tests.schedserver import SchedServer

    nominal = {"base": (TTFT_MS, GAP_MS), "same": (TTFT_MS, GAP_MS),
               # Every request takes 5 % longer (first token and gaps): 1/1.05 of the throughput.
               "slower": (TTFT_MS * 1.05, GAP_MS * 1.05)}
    servers = {name: SchedServer(ttft_ms=ttft, gap_ms=gap, jitter=JITTER, seed=i + 1)
               for i, (name, (ttft, gap)) in enumerate(nominal.items())}
    host = random.Random(seed)
    label = f"drift {drift * 100:.0f} %" if drift else "no drift"
    sweepers = {}
    false = detected = 0
    started = time.monotonic()
    try:
        for name, server in servers.items():
            server.__enter__()
            spec = runner.LoadSpec(base_url=server.base_url, model="sched", levels=(CONCURRENCY,), max_tokens=TOKENS,
                                   input_tokens=16, min_requests=REQUESTS, requests_per_user=1, warmup_per_user=0,
                                   scrape_metrics=False, workers=1)
            sweepers[name] = runner.Sweeper(spec, CONCURRENCY)
        cap = max(max_repeats, repeats)
        z = studystats.sequential_z(cap - repeats + 1)
        used = []
        for i in range(studies):
            reps = {name: [] for name in servers}
            for done in range(1, cap + 1):
                for name, sweeper in sweepers.items():  # interleaved, as a study runs them
                    factor = max(0.5, host.gauss(1, drift)) if drift else 1.0
                    schedule = servers[name].schedule  # read per request: set between levels
                    schedule.ttft_ms, schedule.gap_ms = (v * factor for v in nominal[name])
                    level = sweeper.run_level(CONCURRENCY)
                    samples = runner.request_samples(level.records)
                    reps[name].append(studystats.Repeat(level.output_throughput, tuple(samples["e2e_ms"])))
                if done < repeats:
                    continue
                same = studystats.compare(reps["base"], reps["same"], studystats.INVERSE, seed=i, z=z)
                slower = studystats.compare(reps["base"], reps["slower"], studystats.INVERSE, seed=i, z=z)
                if all(c.verdict in (studystats.BETTER, studystats.WORSE) for c in (same, slower)):
                    break  # every variant decided: the study stops
            used.append(done)
            false += same.verdict != studystats.SAME
            detected += slower.verdict == studystats.WORSE
            if i % 10 == 9 or i == studies - 1:
                print(f"{label}, studies {i + 1}: identical called different {false}, 5 % found {detected} "
                      f"(last: same {same.rel * 100:+.2f} % [{same.rel_low * 100:+.2f}, {same.rel_high * 100:+.2f}], "
                      f"slower {slower.rel * 100:+.2f} % [{slower.rel_low * 100:+.2f}, {slower.rel_high * 100:+.2f}]) "
                      f"{time.monotonic() - started:.0f} s", flush=True)
    finally:
        for sweeper in sweepers.values():
            sweeper.__exit__(None, None, None)
        for server in servers.values():
            server.__exit__(None, None, None)
    suffix = "_drift" if drift else ""
    return {f"false_significant{suffix}_pct": 100.0 * false / studies, f"detected{suffix}_pct": 100.0 * detected / studies,
            f"repeats_mean{suffix}": statistics.fmean(used)}


def schedule_s() -> tuple[float, float]:
    """What the fake engine's schedule takes: (a load and its smoke test, one trial's benchmark)."""
    smoke = (STUDY_TTFT_MS + (SMOKE_TOKENS - 1) * STUDY_GAP_MS) / 1000  # vllm.smoke_test asks for 64 tokens
    request = (STUDY_TTFT_MS + (STUDY_WORKLOAD["max_tokens"] - 1) * STUDY_GAP_MS) / 1000
    level = STUDY_WORKLOAD["levels"][0]
    rounds = math.ceil(max(STUDY_WORKLOAD["min_requests"], STUDY_WORKLOAD["requests_per_user"] * level) / level)
    return LOAD_S + smoke, rounds * request


def overhead(repeats: int) -> dict:
    """One study through the whole panel with the fake engine on a known schedule, timed from outside."""
    var = Path(tempfile.mkdtemp(prefix="perf-tune-"))
    model_dir = var / "fake-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                       "hidden_size": 64, "num_hidden_layers": 2,
                                                       "num_attention_heads": 2, "vocab_size": 256}))
    (model_dir / "fake_engine.json").write_text(json.dumps({
        "load_s": LOAD_S, "python": sys.executable,
        "schedules": {"*": {"ttft_ms": STUDY_TTFT_MS, "gap_ms": STUDY_GAP_MS}}}))
    children = launcher.Children()
    try:
        env = start_panel(var, children, PYTHONUNBUFFERED="1", VLLM_BIN=str(FAKE_VLLM),
                          CHANNELS_PREFIX=f"perftune{os.getpid()}",
                          # The fake engine's schedule server runs on this venv's Python, which the engine user may
                          # not reach (a venv under /root): engines run as the agent's user here, as in tests/integration.
                          PANEL_ENGINE_USER="root")
        children.start("agent", [launcher.PYTHON, "manage.py", "nodeagent", "--name", "perf-tune", "--model-store",
                                 str(var / "store"), "--concurrency", "2"], env)
        from benchmarks import studies, studyresults
        from benchmarks.models import Study, StudyTrial
        from deployments.models import Deployment, ModelCopy, Node
        from deployments.services import deploys, repos
        from tests.conftest import wait_until

        node = wait_until(lambda: Node.objects.filter(name="perf-tune").exclude(engine_flags=[]).first(), timeout=120,
                          interval=0.2, message="the agent and its engine's flags")
        model = repos.model_add_local(node, str(model_dir))
        wait_until(lambda: ModelCopy.objects.filter(model=model, state="ready").exists(), timeout=60, interval=0.2,
                   message="the model copy")
        d = deploys.deployment_create(model=model, node=node, gpu_indices=[], port=launcher.free_port(), preset="auto",
                                      engine_args={"served-model-name": "fake"}, env={})
        try:
            wait_until(lambda: Deployment.objects.get(pk=d.pk).status == "ready", timeout=60, interval=0.2,
                       message="ready")
        except BaseException:
            row = Deployment.objects.get(pk=d.pk)
            raise SystemExit(f"the deployment is {row.status}: {row.status_message}\n" + "\n".join(
                f"{e.step}: {e.message}" for e in row.events.order_by("pk")) + f"\n{row.log_tail[-2000:]}")
        from benchmarks import studyestimate

        parts = studyestimate.study_estimate(Deployment.objects.get(pk=d.pk), 1, STUDY_WORKLOAD)
        print("first study's estimate per trial: " + ", ".join(f"{k} {v}" for k, v in parts.items()), flush=True)
        started = time.monotonic()
        study = studies.study_create(deployment=Deployment.objects.get(pk=d.pk), repeats=repeats,
                                     variants=STUDY_VARIANTS, workload=STUDY_WORKLOAD)
        ended = {}  # trial position -> when this script first saw it end
        after_first = None  # the study's own estimate once its first trial ended: elapsed + what it says is left
        while True:  # this script's clock: poll every 50 ms
            status = Study.objects.filter(pk=study.pk).values_list("status", flat=True).get()
            now = time.monotonic()
            for pos in study.trials.filter(status__in=(StudyTrial.Status.DONE, StudyTrial.Status.FAILED)) \
                    .exclude(position__in=list(ended)).values_list("position", flat=True):
                ended[pos] = now
            if ended and after_first is None:
                left = studyresults.study_live(Study.objects.get(pk=study.pk))["left_s"]
                after_first = None if left is None else (now - started) + left
            if status in Study.TERMINAL:
                break
            if now - started > 600:
                raise SystemExit("the study did not end in 600 s")
            time.sleep(0.05)
        wall = now - started
        study = Study.objects.get(pk=study.pk)
        trials = list(study.trials.select_related("variant").order_by("position"))
        if study.status != "done" or any(t.status != StudyTrial.Status.DONE for t in trials):
            raise SystemExit(f"the study ended {study.status}: {study.error}; trials {[t.status for t in trials]}")
        load_s, bench_s = schedule_s()
        per_trial, previous = [], 0.0
        for t in trials:
            seen = ended[t.position] - started
            per_trial.append(seen - previous - load_s - bench_s)
            previous = seen
            print(f"trial {t.position} ({t.variant.name} #{t.repeat}): ended at {seen:.2f} s, outside overhead "
                  f"{per_trial[-1]:.2f} s, panel's own {t.overhead_s:.2f} s", flush=True)
        # The closing redeploy of the baseline: the study ends once it is ready (before its smoke test).
        closing = LOAD_S if (study.finish_trial or {}).get("sent") else 0.0
        total = wall - len(trials) * (load_s + bench_s) - closing
        print(f"study: {wall:.2f} s wall, {len(trials)} trials of {load_s:.2f} s load + smoke test and {bench_s:.2f} s "
              f"benchmark on schedule, closing load {closing:.2f} s: {total:.2f} s the panel's", flush=True)
        from benchmarks.runner.stats import percentile

        values = sorted(per_trial)
        accounted = sorted(t.overhead_s for t in trials if t.overhead_s is not None)
        figures = {"overhead_p50_s": statistics.median(values), "overhead_p95_s": percentile(values, 95),
                   "overhead_total_s": total, "accounted_p95_s": percentile(accounted, 95) if accounted else float("nan")}
        # The estimate a study is made with (its target: within 30 % of what it took): this first one knew only the
        # deployment's load and smoke test; the same study again knows the first one's trials.
        again = studies.study_create(deployment=Deployment.objects.get(pk=d.pk), repeats=repeats,
                                     variants=STUDY_VARIANTS, workload=STUDY_WORKLOAD)
        wait_until(lambda: Study.objects.get(pk=again.pk).status in Study.TERMINAL, timeout=600, interval=0.2,
                   message="the second study")
        for name, done in (("first", study), ("repeated", Study.objects.get(pk=again.pk))):
            took = studyresults.took_s(done)  # as the study's page and API give it beside its estimate
            err = 100 * (done.estimate_s - took) / took
            print(f"{name} study: estimated {done.estimate_s:.1f} s, took {took:.1f} s ({err:+.0f} %)", flush=True)
            figures[f"estimate_{name}_err_pct"] = err
        if after_first is not None:  # what the page says once the first trial ended ("about N min left")
            err = 100 * (after_first - wall) / wall
            print(f"first study after its first trial: {after_first:.1f} s in all, took {wall:.1f} s ({err:+.0f} %)")
            figures["estimate_after_first_trial_err_pct"] = err
        return figures
    finally:
        stop_engines()
        children.stop()


def estimate_model(rounds: int) -> dict:
    """A run's figures made into another workload's time by the study estimate's model, against the time the
    schedule server's own record says that workload takes; the error's median, least and most over the rounds."""
    from django.apps import apps

    if not apps.ready:  # without the overhead part, which made this process a panel
        os.environ.update({"DJANGO_SETTINGS_MODULE": "controlpanel.settings", "SECRET_KEY": os.urandom(32).hex(),
                           "PANEL_VAR_DIR": tempfile.mkdtemp(prefix="perf-estimate-")})
        import django

        django.setup()  # the model's module imports the models; nothing here touches a database
    from benchmarks import runner, studyestimate
    from tests.schedserver import SchedServer

    measured = {"levels": [1], "max_tokens": 16, "min_requests": 4, "requests_per_user": 4, "warmup_per_user": 0}
    workload = {"levels": [1, 2], "max_tokens": 48, "min_requests": 4, "requests_per_user": 2, "warmup_per_user": 1}
    errors = []
    for i in range(rounds):
        with SchedServer(ttft_ms=30, gap_ms=8) as server:
            spec = runner.LoadSpec(base_url=server.base_url, model="sched", levels=tuple(measured["levels"]),
                                   max_tokens=measured["max_tokens"], min_requests=measured["min_requests"],
                                   requests_per_user=measured["requests_per_user"],
                                   warmup_per_user=measured["warmup_per_user"], scrape_metrics=False, workers=1)
            levels = runner.sweep(spec).levels
            # What the server delivered (on a loaded host it writes late, and the client sees that too).
            ttft_s, gap_s = statistics.median(server.server.truth_ttft), statistics.median(server.server.truth_itl)
        model = studyestimate._modelled(levels, workload)  # a LevelResult has every figure a stored point has
        request_s = ttft_s + (workload["max_tokens"] - 1) * gap_s
        truth = sum(math.ceil(studyestimate._level_counts(workload, c) / c) * request_s for c in workload["levels"])
        errors.append(100 * (model - truth) / truth)
        print(f"estimate round {i + 1}: model {model:.3f} s, the schedule's record {truth:.3f} s ({errors[-1]:+.1f} %)",
              flush=True)
    return {"estimate_model_err_pct": statistics.median(errors), "estimate_model_err_min_pct": min(errors),
            "estimate_model_err_max_pct": max(errors)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-repeats", type=int, default=0, help="adaptive studies: judged after --repeats and after "
                        "each repeat more, stopped when decided or at this many (0: fixed --repeats)")
    parser.add_argument("--drift", type=float, default=0.03, help="host drift between repeats: sd of the factor")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--estimate-rounds", type=int, default=10)
    args = parser.parse_args()
    figures = verdicts(args.studies, args.repeats, max_repeats=args.max_repeats)
    figures.update(verdicts(args.studies, args.repeats, drift=args.drift, seed=1, max_repeats=args.max_repeats))
    if not args.skip_overhead:
        figures.update(overhead(args.repeats))
    figures.update(estimate_model(args.estimate_rounds))
    print(" ".join(f"{k}={v:.2f}" for k, v in figures.items())
          + f" studies={args.studies} repeats={args.repeats} max_repeats={args.max_repeats} drift={args.drift}"
          f" estimate_rounds={args.estimate_rounds}")


if __name__ == "__main__":
    main()
