"""Are a tuning study's verdicts right, and what does the panel add per variant? (issue 15)

Verdicts, no engine: many small studies against three OpenAI-compatible test servers with a known
schedule (tests/schedserver.py), each request's token gap drawn from the schedule's gap ± 5 %
(uniform): "base" and "same" share a schedule, "slower" takes 5 % longer per request. Each study runs the
default 3 repeats interleaved (base same slower base same slower …) with the real load generator
(benchmarks.runner) and judges output tok/s with benchmarks.tunestats, as the panel does:

  false_significant_pct  identical variants called better or worse (target <= 5)
  detected_pct           the true 5 % difference found, and the right way round (target >= 90)

Overhead, no engine either: the panel runs as in production (an embedded Redis, SQLite, a real node
agent) with tests/faults' fake vLLM (loads in 1 s, streams tokens 1 ms apart) and one study of a
baseline and two variants × 3 repeats. Each trial records its wall time less the plan's steps
(stop, launch, load, smoke test) and its benchmark run's time: the panel's own part.

  overhead_p95_s         95th percentile over the trials (target <= 2)

    python perf/tune_verdicts.py [--studies 60] [--skip-overhead]

Last line: name=value pairs.
"""
import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from controlpanel import launcher  # noqa: E402

FAKE_VLLM = ROOT / "tests" / "faults" / "fakevllm" / "vllm"
CONCURRENCY, TOKENS, REQUESTS, GAP_MS, TTFT_MS, JITTER = 4, 24, 16, 2.0, 5.0, 0.05


def verdicts(studies: int, repeats: int) -> dict:
    from benchmarks import runner, tunestats
    from tests.schedserver import SchedServer

    servers = {"base": SchedServer(ttft_ms=TTFT_MS, gap_ms=GAP_MS, jitter=JITTER, seed=1),
               "same": SchedServer(ttft_ms=TTFT_MS, gap_ms=GAP_MS, jitter=JITTER, seed=2),
               # Every request takes 5 % longer (first token and gaps): 1/1.05 of the throughput.
               "slower": SchedServer(ttft_ms=TTFT_MS * 1.05, gap_ms=GAP_MS * 1.05, jitter=JITTER, seed=3)}
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
        for i in range(studies):
            reps = {name: [] for name in servers}
            for _ in range(repeats):
                for name, sweeper in sweepers.items():  # interleaved, as a study runs them
                    level = sweeper.run_level(CONCURRENCY)
                    samples = runner.request_samples(level.records)
                    reps[name].append(tunestats.Repeat(level.output_throughput, tuple(samples["e2e_ms"])))
            same = tunestats.compare(reps["base"], reps["same"], tunestats.INVERSE, seed=i)
            slower = tunestats.compare(reps["base"], reps["slower"], tunestats.INVERSE, seed=i)
            false += same.verdict != tunestats.SAME
            detected += slower.verdict == tunestats.WORSE
            if i % 10 == 9 or i == studies - 1:
                print(f"studies {i + 1}: identical called different {false}, 5 % found {detected} "
                      f"(last: same {same.rel * 100:+.2f} % [{same.rel_low * 100:+.2f}, {same.rel_high * 100:+.2f}], "
                      f"slower {slower.rel * 100:+.2f} % [{slower.rel_low * 100:+.2f}, {slower.rel_high * 100:+.2f}]) "
                      f"{time.monotonic() - started:.0f} s", flush=True)
    finally:
        for sweeper in sweepers.values():
            sweeper.__exit__(None, None, None)
        for server in servers.values():
            server.__exit__(None, None, None)
    return {"false_significant_pct": 100.0 * false / studies, "detected_pct": 100.0 * detected / studies}


def overhead(repeats: int) -> dict:
    """One study through the whole panel with the fake engine; the trials' overhead as recorded."""
    var = Path(tempfile.mkdtemp(prefix="perf-tune-"))
    model_dir = var / "fake-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                       "hidden_size": 64, "num_hidden_layers": 2,
                                                       "num_attention_heads": 2, "vocab_size": 256}))
    (model_dir / "fake_engine.json").write_text(json.dumps({"load_s": 1.0}))
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(PANEL_VAR_DIR=str(var), DATABASE_URL=f"sqlite:///{var / 'panel.sqlite3'}", PYTHONUNBUFFERED="1",
               VLLM_BIN=str(FAKE_VLLM), CPU_HOST_EXCLUSIVE="0", DJANGO_SETTINGS_MODULE="controlpanel.settings",
               CHANNELS_PREFIX=f"perftune{os.getpid()}", SECRET_KEY=secrets.token_urlsafe(50))
    children = launcher.Children()
    try:
        env["REDIS_URL"] = launcher.start_embedded_redis(children, env, var)
        os.environ.update(env)
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        children.start("agent", [launcher.PYTHON, "manage.py", "nodeagent", "--name", "perf-tune", "--model-store",
                                 str(var / "store"), "--concurrency", "2"], env)
        from benchmarks import studies
        from benchmarks.models import Study
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
        wait_until(lambda: Deployment.objects.get(pk=d.pk).status == "ready", timeout=60, interval=0.2, message="ready")
        study = studies.study_create(deployment=Deployment.objects.get(pk=d.pk), repeats=repeats,
                                     variants=[{"name": "8", "engine_args": {"max-num-seqs": 8}, "env": {}},
                                               {"name": "4", "engine_args": {"max-num-seqs": 4}, "env": {}}],
                                     workload={"levels": [4], "max_tokens": 32, "requests_per_user": 2, "min_requests": 8,
                                               "warmup_per_user": 0})
        study = wait_until(lambda: (s := Study.objects.get(pk=study.pk)).status in Study.TERMINAL and s, timeout=600,
                           interval=1, message="the study")
        trials = list(study.trials.exclude(overhead_s=None))
        for t in trials:
            print(f"trial {t.position} ({t.variant.name} #{t.repeat}): {t.status}, ready after {t.ready_s} s, "
                  f"panel overhead {t.overhead_s:.2f} s", flush=True)
        if study.status != "done" or not trials:
            raise SystemExit(f"the study ended {study.status}: {study.error}")
        from benchmarks.runner.stats import percentile

        values = sorted(t.overhead_s for t in trials)
        return {"overhead_p50_s": statistics.median(values), "overhead_p95_s": percentile(values, 95)}
    finally:
        try:
            from deployments.host import engine
            from deployments.models import Deployment

            for pgid in Deployment.objects.exclude(pgid=None).values_list("pgid", flat=True):
                engine.stop(pgid, term_timeout_s=5, kill_timeout_s=5)
        except Exception as exc:  # noqa: BLE001 - Django may not be set up
            print(f"note: engines not checked: {exc}", file=sys.stderr)
        children.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    figures = verdicts(args.studies, args.repeats)
    if not args.skip_overhead:
        figures.update(overhead(args.repeats))
    print(" ".join(f"{k}={v:.2f}" for k, v in figures.items()) + f" studies={args.studies} repeats={args.repeats}")


if __name__ == "__main__":
    main()
