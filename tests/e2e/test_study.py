"""A tuning study end to end on the real CPU engine, started through the REST API and driven by a real
node agent: each trial measures an engine launched with its variant's --max-num-seqs (read from the
process), a variant with an invalid flag value is recorded as failed (its later repeat skipped) while the
study finishes, the agent killed (SIGKILL) while a variant loads resumes the study, and the deployment
ends on the baseline's settings. Which variant is faster is not asserted here: measured on this shared
host, that flips. The verdicts are tested on known schedules in tests/integration/test_study_verdicts.py
and measured in perf/study_verdicts.py.

One study covers it all, with the fewest loads that can (each takes ~30 s here): 2 repeats of the
baseline and one variant in mirrored order (baseline, four, bad | four, baseline: the last trial leaves the
baseline running, so no closing reload), and a variant that fails fast."""
import os
import signal

import pytest

from benchmarks.models import BenchmarkRun, Study, StudyTrial
from benchmarks.services import engine_command
from deployments.models import Deployment, Node
from deployments.services import deploys
from tests.conftest import agent_argv, free_port, in_thread, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
# 8 requests of 16 tokens at concurrency 4, no warmup: what is measured is which engine, not how fast.
WORKLOAD = {"levels": [4], "max_tokens": 16, "input_tokens": 16, "requests_per_user": 2, "min_requests": 8,
            "warmup_per_user": 0}


def settled(d, states=("ready", "failed")):
    return wait_until(lambda: (row := Deployment.objects.get(pk=d.pk)).status in states and row, timeout=300,
                      interval=0.5, message=f"deployment {d.pk} to be {' or '.join(states)}")


def served_seqs(run) -> str | None:
    """--max-num-seqs of the engine process the run measured (from its recorded command line)."""
    words = run.environment.get("engine_command", "").split()
    return words[words.index("--max-num-seqs") + 1] if "--max-num-seqs" in words else None


def trial_table(study) -> list[tuple]:
    """Each trial as run: variant, status, attempts, the flags its run recorded, output tok/s at 4."""
    rows = []
    for t in study.trials.select_related("variant", "run").order_by("position"):
        point = t.run.points.filter(concurrency=4).first() if t.run else None
        rows.append((t.position, t.variant.name, t.status, t.attempts, t.error[:60],
                     served_seqs(t.run) if t.run else None,
                     point and round(point.output_throughput, 1)))
    return rows


def restart_agent(spawn, env, node, tmp_path):
    """SIGKILL the node agent (its engines live on in their own sessions) and start a new one."""
    old = Node.objects.get(pk=node.pk).agent_pid
    os.killpg(old, signal.SIGKILL)
    spawn(agent_argv(node.name, tmp_path / "store", sample_seconds=1, heartbeat_seconds=2), env, name=f"{node.name}-again")
    wait_until(lambda: Node.objects.get(pk=node.pk).agent_pid not in (None, old), timeout=90, interval=0.5,
               message="the new agent to register")


@pytest.fixture
def study_node(process_env, spawn, unique, tmp_path, tiny_model):
    """cpu_node's agent, with the environment it runs in (to start it again)."""
    from deployments.host import processes
    from tests.e2e.conftest import start_cpu_node

    node, model, env = start_cpu_node(process_env, spawn, unique, tmp_path, tiny_model)
    yield node, model, env
    # Engines run in their own sessions and outlive a killed agent: never leave one behind.
    for pgid in Deployment.objects.filter(node=node).exclude(pgid=None).values_list("pgid", flat=True):
        processes.stop(pgid, term_timeout_s=5, kill_timeout_s=5)


@pytest.mark.slow
def test_a_study_measures_real_variants_records_a_failed_one_and_survives_an_agent_kill(
        study_node, spawn, tmp_path, api):
    """Slow: five or six real engine loads of ~30 s here (the deployment, 2 of the baseline, 2 of "four" and
    the one the agent kill may cost again) and a failed one: loading is what is tested."""
    node, model, env = study_node
    d = in_thread(deploys.deployment_create, model=model, node=node, gpu_indices=[], port=free_port(), preset="auto",
                  engine_args={"served-model-name": "tiny", "max-num-seqs": 1}, env={})
    assert settled(d).status == "ready"
    body = {"deployment": d.pk, "repeats": 2, "order": "mirrored", "workload": WORKLOAD,
            "rule": {"kind": "throughput", "level": 4},
            "variants": [{"name": "four", "engine_args": {"max-num-seqs": 4}},
                         {"name": "bad", "engine_args": {"dtype": "no-such-dtype"}}]}
    unknown = api.post("/api/studies/", {**body, "variants": [{"engine_args": {"max-num-seqz": 4}}]}, format="json")
    assert unknown.status_code == 400 and "unknown engine flag --max-num-seqz" in unknown.json()["error"]["message"]
    created = api.post("/api/studies/", body, format="json")
    assert created.status_code == 202, created.content
    study = Study.objects.get(pk=created.json()["id"])

    # The second trial ("four", repeat 1) loading: the agent is killed and started again.
    wait_until(lambda: study.trials.filter(position=1, status="deploying").exists()
               and Deployment.objects.get(pk=d.pk).status == "loading", timeout=480, interval=0.2,
               message="the second trial to be loading")
    restart_agent(spawn, env, node, tmp_path)

    study = wait_until(lambda: (row := Study.objects.get(pk=study.pk)).status in Study.TERMINAL and row, timeout=600,
                       interval=1, message="the study to finish")
    assert study.status == "done", (study.error, trial_table(study))
    bad = study.variants.get(name="bad")
    good = study.trials.exclude(variant=bad)
    # Each trial measured an engine launched with its variant's settings (read from the process).
    assert sorted((t.variant.name, t.repeat, served_seqs(t.run)) for t in good.select_related("variant", "run")) == [
        ("baseline", 1, "1"), ("baseline", 2, "1"), ("four", 1, "4"), ("four", 2, "4")], trial_table(study)
    assert bad.failed and list(bad.trials.values_list("status", flat=True)) == ["failed", "skipped"], trial_table(study)
    assert "dtype" in bad.failed, bad.failed
    assert set(good.values_list("status", flat=True)) == {StudyTrial.Status.DONE}
    # Per-request figures kept for the bootstrap (tok/s per user may be empty: a request whose chunks all
    # arrived in one read has no time after its first token).
    assert all(len(t.run.points.get(concurrency=4).samples["e2e_ms"]) == WORKLOAD["min_requests"] for t in good)
    assert good.exclude(startup={}).exists()  # phases of a load the agent was not killed in
    assert {r["name"]: r["repeats_done"] for r in study.results["variants"]} == {"baseline": 2, "four": 2, "bad": 0}
    # The end: the deployment runs the baseline's settings again, and so does its engine's process, the one the
    # last trial (the baseline's second) measured: no closing reload.
    row = settled(d, ("ready",))
    last = study.trials.order_by("-position").exclude(status="skipped").first()
    assert last.variant.is_baseline and row.ready_at == last.ready_at, trial_table(study)
    assert row.engine_args["max-num-seqs"] == 1 and "dtype" not in row.engine_args
    assert served_seqs(BenchmarkRun(environment={"engine_command": engine_command(row)})) == "1"
    shown = api.get(f"/api/studies/{study.pk}/").json()
    assert shown["live"]["trials_done"] == 6 and shown["status"] == "done"
