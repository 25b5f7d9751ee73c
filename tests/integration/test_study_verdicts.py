"""A tuning study's verdicts on engines whose speed is known: a real node agent drives the study through
the plan and the benchmark runner as in production, with tests/faults' fake vLLM serving each variant on
a tests/schedserver.py schedule keyed by its --max-num-seqs. The real CPU engine runs a study in
tests/e2e/test_study.py, where nothing is asserted about which variant was faster; perf/study_verdicts.py
measures how often the verdicts are right with smaller differences and host drift.

The differences are chosen far from what a busy host can blur:
- "fast" streams 4x faster than the baseline (TTFT 10 ms and 4 ms a token against 40 and 16): it is
  "better" unless the interval's lower end lies three baseline throughputs below its centre.
- "same" is the baseline's schedule, jitter seed included: every fresh engine draws the same per-request
  gaps (±50 %), so the two measure the same requests and differ only by the host's noise, while the
  interval is as wide as those gaps' spread makes it (about ±40 % at 2 repeats). A calibrated interval
  calls independent identical variants different 5 % of the time; these are identical draw for draw.
"""
import json
import sys

import pytest

from benchmarks.models import Study, StudyTrial
from benchmarks.studies import study_create
from deployments.models import Deployment
from deployments.services import deploys
from tests.conftest import free_port, in_thread, wait_until
from tests.faults.conftest import Agent, add_fake_model, agent_env, fake_model, stop_leftover_engines  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
SLOW = {"ttft_ms": 40, "gap_ms": 16, "jitter": 0.5, "seed": 7}
SCHEDULES = {"1": SLOW, "16": {**SLOW, "ttft_ms": 10, "gap_ms": 4}}
# 12 requests of 24 tokens at concurrency 4, no warmup: ~1.2 s a trial at the baseline's schedule.
WORKLOAD = {"levels": [4], "max_tokens": 24, "input_tokens": 16, "requests_per_user": 3, "min_requests": 12,
            "warmup_per_user": 0}


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


def test_a_variant_four_times_faster_is_better_and_an_identical_one_is_no_different(scheduled):
    study = in_thread(study_create, deployment=scheduled, repeats=2, workload=WORKLOAD,
                      variants=[{"name": "fast", "engine_args": {"max-num-seqs": 16}, "env": {}},
                                {"name": "same", "engine_args": {"max-num-seqs": 1}, "env": {}}])
    study = wait_until(lambda: (s := Study.objects.get(pk=study.pk)).status in Study.TERMINAL and s, timeout=240,
                       interval=0.5, message="the study to finish")
    assert study.status == "done", study.error
    assert set(study.trials.values_list("status", flat=True)) == {StudyTrial.Status.DONE}
    # Each trial measured the engine its variant's flags started, so each streamed its schedule.
    for t in study.trials.select_related("variant", "run"):
        words = t.run.environment["engine_command"].split()
        assert words[words.index("--max-num-seqs") + 1] == {"baseline": "1", "fast": "16", "same": "1"}[t.variant.name]
    cmp = {r["name"]: r["comparisons"].get("throughput@4") for r in study.results["variants"]}
    assert cmp["fast"]["verdict"] == "better", cmp
    assert cmp["same"]["verdict"] == "no significant difference", cmp
    assert cmp["same"]["low"] < 0 < cmp["same"]["high"] and cmp["fast"]["low"] > 0, cmp
    assert study.results["winner"] == study.variants.get(name="fast").pk
