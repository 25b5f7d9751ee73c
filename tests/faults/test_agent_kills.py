"""SIGKILL the node agent mid-download, mid-load and mid-stop, at random moments, FAULT_KILLS times
each, and check after each restart: the true state in the API, no engine process that nobody owns,
no stale /dev/shm file, and downloads resumed and sha256-verified. Real agents, a real
Hub-compatible server and the fake engine (the real CPU vLLM's kill is tests/e2e/test_engine_kill.py)."""
import json
import os
import time
from pathlib import Path

import pytest

from deployments.host import downloads
from deployments.models import ModelCopy, ModelRepo
from deployments.services import deploys, repos
from tests.conftest import in_thread, wait_until
from tests.faults.conftest import KILLS, sha256
from tests.hfserver import configure, serve
from tests.truestate import (COUNTS, Agent, add_fake_model, agent_env, assert_true_state, deploy, random_moment,
                             set_load, settle, stop_and_check, stop_leftover_engines)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
MB = 1 << 20


@pytest.mark.timeout(120 + 30 * KILLS)
def test_agent_killed_mid_load_again_and_again_ends_in_the_true_state(fault_agent, fake_model):
    node = fault_agent.node
    model = add_fake_model(node, fake_model)
    set_load(fake_model, 1.5)
    outcomes = []
    for _ in range(KILLS):
        d = deploy(model, node)
        wait_until(lambda: settle_state(d) != "queued", timeout=20, message="the plan to start")
        time.sleep(random_moment(0.0, 2.5))
        fault_agent.restart()
        row = settle(d, timeout=60, states={"ready", "failed"})
        outcomes.append(row.status)
        assert_true_state(d, fake_model)
        stop_and_check(d, fake_model)
    COUNTS["kills_mid_load"] += KILLS
    print(f"mid-load kills: {KILLS}, outcomes {sorted(outcomes)}")


def settle_state(d):
    from deployments.models import Deployment

    return Deployment.objects.get(pk=d.pk).status


@pytest.mark.timeout(120 + 30 * KILLS)
def test_agent_killed_mid_stop_again_and_again_ends_stopped_with_nothing_left(fault_agent, fake_model):
    node = fault_agent.node
    model = add_fake_model(node, fake_model)
    set_load(fake_model, 0.2)
    for _ in range(KILLS):
        d = deploy(model, node)
        assert settle(d, timeout=30).status == "ready"
        assert_true_state(d, fake_model)
        deploys.deployment_stop(d)
        time.sleep(random_moment(0.0, 0.6))
        fault_agent.restart()
        row = settle(d, timeout=60, states={"stopped", "failed"})
        assert row.status == "stopped", row.status_message
        assert_true_state(d, fake_model)
    COUNTS["kills_mid_stop"] += KILLS


@pytest.fixture
def tiny_repos(tmp_path):
    """KILLS small repos on a Hub-compatible server (config + two weight files)."""
    root = tmp_path / "hub"
    for i in range(KILLS):
        repo = root / "acme" / f"tiny-{i}"
        repo.mkdir(parents=True)
        (repo / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                      "hidden_size": 64, "num_hidden_layers": 2,
                                                      "num_attention_heads": 2, "vocab_size": 256}))
        (repo / "model-00001-of-00002.safetensors").write_bytes(os.urandom(2 * MB))
        (repo / "model-00002-of-00002.safetensors").write_bytes(os.urandom(1 * MB))
    with serve(root) as url:
        yield url, root


@pytest.mark.timeout(120 + 30 * KILLS)
def test_agent_killed_mid_download_again_and_again_resumes_and_verifies(process_env, spawn, unique, tmp_path,
                                                                         settings, tiny_repos):
    url, root = tiny_repos
    settings.HF_ENDPOINT = url
    agent = Agent(spawn, agent_env(process_env, tmp_path, HF_ENDPOINT=url), f"dl-{unique}", tmp_path / "store")
    node = agent.start()
    configure(url, throttle_bps=2 * MB)  # ~1.5 s a download: the kill lands inside it
    for i in range(KILLS):
        model = ModelRepo.objects.create(repo_id=f"acme/tiny-{i}")
        in_thread(repos.model_inspect, model.pk)
        model.refresh_from_db()
        copy = repos.model_download(model, node)
        wait_until(lambda: ModelCopy.objects.get(pk=copy.pk).state == "downloading", timeout=20,
                   message="the download to start")
        time.sleep(random_moment(0.0, 1.2))
        agent.restart()
        done = wait_until(lambda: (c := ModelCopy.objects.get(pk=copy.pk)).state in ("ready", "failed") and c,
                          timeout=60, message="the resumed download")
        assert done.state == "ready", done.error
        dest = Path(done.path)
        for source in sorted(p for p in (root / "acme" / f"tiny-{i}").iterdir()):
            assert sha256(dest / source.name) == sha256(source), source.name
        assert not list((dest / downloads.PARTIAL_DIR).rglob("*.part")), "partial files left behind"
    COUNTS["kills_mid_download"] += KILLS
    stop_leftover_engines(tmp_path)
