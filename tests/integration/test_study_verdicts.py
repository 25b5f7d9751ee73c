"""A tuning study's verdicts on engines whose speed is known: a real node agent drives the study through
the plan and the benchmark runner as in production, with tests/faults' fake vLLM serving each variant on
a tests/schedserver.py schedule keyed by its --max-num-seqs. The real CPU engine runs a study in
tests/e2e/test_study.py, where nothing is asserted about which variant was faster; perf/study_verdicts.py
measures how often the verdicts are right with smaller differences and host drift.

The verdicts are structural, not a race with the host (tests/benchmarks/studyschedules.py has the schedules):
- "fast" streams 8x faster than the baseline (gaps of 32 ms against 256 ms; 0.23 s a request against 1.8 s).
- "same" is the baseline's schedule, jitter seed included: every fresh engine draws the same per-request gaps
  (±80 %), so the two measure the same requests and differ only by the host's delays, while the interval is as
  wide as those gaps' spread makes it.
- 4 repeats: a slow repeat weighs a quarter, not a half, and the interval is widened less (Student's t with 6
  degrees of freedom, not 2).
tests/benchmarks/test_studystats.py judges these very trials as a punctual server delivers them: the verdicts
stand every request of any fast repeat, or of every "same" repeat, 0.5 s late (the busy host where the 4x variant
at 2 repeats was judged no different made requests ~70 ms late).
"""
import json
import sys
from pathlib import Path

import pytest

from benchmarks.models import Study, StudyTrial
from benchmarks.studies import study_create
from deployments.models import Deployment
from deployments.services import deploys
from tests.benchmarks.studyschedules import BASELINE, FAST, REPEATS, SCHEDULES, WORKLOAD, floor_ms
from tests.conftest import free_port, in_thread, wait_until
from tests.faults.conftest import Agent, add_fake_model, agent_env, fake_model, stop_leftover_engines  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

@pytest.fixture
def scheduled(process_env, spawn, unique, tmp_path, fake_model):  # noqa: F811 - the imported fixture
    """A ready deployment (--max-num-seqs 1) of the fake engine on SCHEDULES, driven by a real agent."""
    (fake_model / "fake_engine.json").write_text(json.dumps({"load_s": 0.3, "python": sys.executable,
                                                             "schedules": SCHEDULES}))
    # The schedule server runs on this venv's Python (under /root, which the engine user cannot enter): the engine
    # user is not what this test is about, so engines run as the agent's user here.
    agent = Agent(spawn, agent_env(process_env, tmp_path, PANEL_ENGINE_USER="root"), f"verdicts-{unique}",
                  tmp_path / "store")
    node = agent.start()
    model = in_thread(add_fake_model, node, fake_model)
    d = in_thread(deploys.deployment_create, model=model, node=node, gpu_indices=[], port=free_port(),
                  engine_args={"served-model-name": "fake", "max-num-seqs": 1}, env={}, name=f"sched-{unique}")
    wait_until(lambda: Deployment.objects.get(pk=d.pk).status == "ready", timeout=60, message="the deployment")
    yield Deployment.objects.get(pk=d.pk)
    agent.kill()  # first, so it starts no engine after the check below
    stop_leftover_engines(tmp_path)


def _log_tail(d: Deployment) -> str:
    """The last engine's log, for a failure's message."""
    path = Path(d.log_path) if d.log_path else None
    return path.read_text(errors="replace")[-3000:] if path and path.exists() else f"(no log at {d.log_path!r})"


@pytest.mark.slow
def test_a_variant_eight_times_faster_is_better_and_an_identical_one_is_no_different(scheduled):
    """Slow (about a minute here) because the margin that makes the verdicts structural costs time: 12 trials,
    each a redeploy through the plan (~3 s of agent steps, load and smoke test), and the baseline's requests on a
    schedule slow enough that half a second of host delay per request turns no verdict."""
    study = in_thread(study_create, deployment=scheduled, repeats=REPEATS, workload=WORKLOAD,
                      variants=[{"name": "fast", "engine_args": {"max-num-seqs": 16}, "env": {}},
                                {"name": "same", "engine_args": {"max-num-seqs": 1}, "env": {}}])
    study = wait_until(lambda: (s := Study.objects.get(pk=study.pk)).status in Study.TERMINAL and s, timeout=240,
                       interval=0.5, message="the study to finish")
    assert study.status == "done", (study.error, _log_tail(Deployment.objects.get(pk=scheduled.pk)))
    assert set(study.trials.values_list("status", flat=True)) == {StudyTrial.Status.DONE}, [
        (t.variant.name, t.repeat, t.status, t.error) for t in study.trials.select_related("variant")]
    # Each trial measured the engine its variant's flags started, and that engine streamed its schedule: every
    # token asked for, no request sooner than its schedule allows (the server is never early).
    measured = {}
    for t in study.trials.select_related("variant", "run"):
        words = t.run.environment["engine_command"].split()
        assert words[words.index("--max-num-seqs") + 1] == {"baseline": "1", "fast": "16", "same": "1"}[t.variant.name]
        point = t.run.points.get()
        assert point.output_tokens == WORKLOAD["min_requests"] * WORKLOAD["max_tokens"] and point.failed_requests == 0
        floor = floor_ms(FAST if t.variant.name == "fast" else BASELINE)
        assert min(point.samples["e2e_ms"]) >= floor, (t.variant.name, point.samples["e2e_ms"])
        measured.setdefault(t.variant.name, []).append(round(point.output_throughput))
    cmp = {r["name"]: r["comparisons"].get("throughput@8") for r in study.results["variants"]}
    assert cmp["fast"]["verdict"] == "better", (cmp, measured)
    assert cmp["same"]["verdict"] == "no significant difference", (cmp, measured)
    assert cmp["same"]["low"] < 0 < cmp["same"]["high"] and cmp["fast"]["low"] > 0, (cmp, measured)
    assert study.results["winner"] == study.variants.get(name="fast").pk
