"""SIGKILL the node agent in the middle of a phase, FAULT_KILLS times each: while the panel shows an engine loading,
while it shows one stopping, and inside a file of a download. Each kill waits for its phase (the fake engine made slow
to load or to stop, a file's partial holding some of its bytes) and lands at a random moment inside it, checked
after the kill; then the restarted agent must finish what was cut: adopt the loading engine (ready, the same PID),
finish the stop (stopped, nothing left), resume the file from where it stopped (a Range request for the rest,
sha256-verified). After each: the true state in the API, no engine nobody owns, no stale /dev/shm file. Real agents,
a real Hub-compatible server and the fake engine (the real CPU vLLM's kill is tests/e2e/test_engine_kill.py)."""
import json
import os
import time
from pathlib import Path

import httpx
import pytest

from deployments.host import downloads
from deployments.models import Deployment, ModelCopy, ModelRepo
from deployments.services import deploys, repos
from tests.conftest import in_thread, wait_until
from tests.factories import UserFactory
from tests.faults.conftest import KILLS, sha256
from tests.helpers import api_client, pid_alive
from tests.hfserver import configure, get_stats, reset_stats, serve
from tests.truestate import (COUNTS, Agent, add_fake_model, agent_env, assert_true_state, deploy, random_moment,
                             set_load, settle, stop_and_check, stop_leftover_engines)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
MB = 1 << 20
LOAD_S = 4.0  # the fake engine's load; the kill lands in its first half
DRAIN_S = 10.0  # after its SIGTERM the fake engine drains this long, as vLLM's API server with connections open
STOP_KILL_WITHIN_S = 2.0  # the kill lands this long at most after the engine was told to stop


@pytest.fixture
def viewer():
    return api_client(UserFactory(role="viewer"))


def _shown(api, d) -> str:
    """The deployment's status as the panel shows it."""
    return api.get(f"/api/deployments/{d.pk}/").json()["status"]


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.timeout(120 + 40 * KILLS)
def test_agent_killed_while_the_engine_loads_adopts_the_loading_engine_and_ends_ready(fault_agent, fake_model, viewer):
    node = fault_agent.node
    model = add_fake_model(node, fake_model)
    hold = fake_model.parent / f"{fake_model.name}.hold"
    set_load(fake_model, LOAD_S, hold=hold)  # the load lasts until the test lets it end: the kill is always inside it
    for _ in range(KILLS):
        hold.touch()
        d = deploy(model, node)
        wait_until(lambda: _shown(viewer, d) == "loading", timeout=30, message="the panel to show the engine loading")
        time.sleep(random_moment(0.0, LOAD_S / 2))
        fault_agent.kill()
        row = Deployment.objects.get(pk=d.pk)
        # The kill landed in the load: the row still says loading and the engine does not answer yet.
        assert row.status == "loading" and row.pid, f"the kill landed outside the load: {row.status}, PID {row.pid}"
        assert not _answers(row.port), "the engine answered while its load was held: the fake engine ignores the hold"
        loading = row.pid
        hold.unlink()  # the load goes on to its end while the agent is down
        fault_agent.start()
        row = settle(d, timeout=60, states={"ready", "failed"})
        assert row.status == "ready", row.status_message  # the restarted agent followed the load to its end
        assert row.pid == loading, f"ready with PID {row.pid}, not the engine that was loading (PID {loading})"
        assert_true_state(d, fake_model)
        stop_and_check(d, fake_model)
    COUNTS["kills_mid_load"] += KILLS


@pytest.mark.timeout(120 + 40 * KILLS)
def test_agent_killed_while_the_engine_stops_ends_stopped_with_no_engine_left(fault_agent, fake_model, viewer):
    node = fault_agent.node
    model = add_fake_model(node, fake_model)
    set_load(fake_model, 0.2, stop_s=DRAIN_S)
    for _ in range(KILLS):
        d = deploy(model, node)
        row = settle(d, timeout=30)
        assert row.status == "ready", row.status_message
        assert_true_state(d, fake_model)
        engine = row.pid
        deploys.deployment_stop(row)
        # In the stop: the panel shows stopping, and the engine has had its SIGTERM (its port is closed).
        wait_until(lambda: _shown(viewer, d) == "stopping" and not _answers(row.port), timeout=30,
                   message="the panel to show the engine stopping and the engine to be told")
        time.sleep(random_moment(0.0, STOP_KILL_WITHIN_S))
        fault_agent.kill()
        cut = Deployment.objects.get(pk=d.pk)
        assert cut.status == "stopping", f"the kill landed outside the stop: {cut.status}"
        assert pid_alive(engine), "the engine had exited before the kill: it did not land in the stop"
        fault_agent.start()
        row = settle(d, timeout=60, states={"stopped", "failed"})
        assert row.status == "stopped", row.status_message  # the restarted agent finished the stop
        assert not pid_alive(engine), f"stopped, but its engine (PID {engine}) still runs"
        assert_true_state(d, fake_model)
    COUNTS["kills_mid_stop"] += KILLS


CUT_FILE = "model-00001-of-00002.safetensors"  # the file the kill cuts
BLOCK = downloads.CHUNK_BYTES  # a partial grows a block at a time
CUT_SIZE = 3 * BLOCK  # three blocks: the partial holds some but not all of it for two blocks' time
RATE = 4 * MB  # bytes per second per response: CUT_FILE takes 6 s


@pytest.fixture
def tiny_repos(tmp_path):
    """KILLS small repos on a Hub-compatible server (config + two weight files), the big one shared (linked)."""
    root = tmp_path / "hub"
    big = tmp_path / "big.safetensors"
    big.write_bytes(os.urandom(CUT_SIZE))
    for i in range(KILLS):
        repo = root / "acme" / f"tiny-{i}"
        repo.mkdir(parents=True)
        (repo / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                      "hidden_size": 64, "num_hidden_layers": 2,
                                                      "num_attention_heads": 2, "vocab_size": 256}))
        os.link(big, repo / CUT_FILE)
        (repo / "model-00002-of-00002.safetensors").write_bytes(os.urandom(1 * MB))
    with serve(root) as url:
        yield url, root


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


@pytest.mark.timeout(120 + 40 * KILLS)
def test_agent_killed_inside_a_file_resumes_it_from_where_it_stopped_and_verifies(process_env, spawn, unique, tmp_path,
                                                                               settings, tiny_repos):
    url, root = tiny_repos
    settings.HF_ENDPOINT = url
    agent = Agent(spawn, agent_env(process_env, tmp_path, HF_ENDPOINT=url), f"dl-{unique}", tmp_path / "store")
    node = agent.start()
    configure(url, throttle_bps=RATE)
    for i in range(KILLS):
        model = ModelRepo.objects.create(repo_id=f"acme/tiny-{i}")
        in_thread(repos.model_inspect, model.pk)
        model.refresh_from_db()
        source = root / "acme" / f"tiny-{i}"
        size = (source / CUT_FILE).stat().st_size
        reset_stats(url)
        copy = repos.model_download(model, node)
        dest = Path(wait_until(lambda: (c := ModelCopy.objects.get(pk=copy.pk)).state == "downloading" and c.path,
                               timeout=20, message="the download to start"))
        part = dest / downloads.PARTIAL_DIR / f"{CUT_FILE}.part"
        wait_until(lambda: _size(part) >= BLOCK, timeout=30, message=f"the first block of {CUT_FILE} on disk")
        time.sleep(random_moment(0.0, BLOCK / RATE / 2))  # within the next block's time: the file is far from done
        agent.kill()
        kept = _size(part)
        assert 0 < kept < size and not (dest / CUT_FILE).exists(), \
            f"the kill landed outside {CUT_FILE}: {kept} of {size} bytes on disk"
        agent.start()
        done = wait_until(lambda: (c := ModelCopy.objects.get(pk=copy.pk)).state in ("ready", "failed") and c,
                          timeout=60, message="the resumed download")
        assert done.state == "ready", done.error
        for file in sorted(source.iterdir()):
            assert sha256(dest / file.name) == sha256(file), file.name
        assert not list((dest / downloads.PARTIAL_DIR).rglob("*.part")), "partial files left behind"
        requests = get_stats(url)["requests"]
        asked = [r["range"] for r in requests if (r["repo"], r["path"]) == (f"acme/tiny-{i}", CUT_FILE)]
        # The file from its start, then the rest of it only: from the bytes the killed agent had written.
        assert asked == [None, f"bytes={kept}-"], f"{CUT_FILE} requested with Range {asked}; {kept} bytes were kept"
    COUNTS["kills_mid_download"] += KILLS
    stop_leftover_engines(tmp_path)
