"""A real download by a real node agent from a Hugging Face-compatible server: live progress in
Chromium, the agent SIGKILLed midway through a 210 MB file, restarted, and the transfer resumes
where it stopped and verifies every file; a deployment stopped while it prepares cancels the download
its plan started."""
import hashlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from playwright.sync_api import expect

from deployments.host import downloads
from deployments.models import Deployment, ModelCopy, ModelRepo, Node
from deployments.services import deploys, repos
from tests.conftest import agent_argv, in_thread, wait_until
from tests.hfserver import configure, get_stats, reset_stats, serve

pytestmark = pytest.mark.e2e
MB = 1 << 20
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
          "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}


def _random_file(path: Path, size: int) -> None:
    block = bytearray(os.urandom(8 * MB))
    with open(path, "wb") as f:
        for i in range(0, size, len(block)):
            block[:8] = i.to_bytes(8, "little")
            f.write(block[: min(len(block), size - i)])


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MB):
            h.update(chunk)
    return h.hexdigest()


def _on_disk(dest: Path) -> int:
    return sum(p.stat().st_size for p in dest.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".part"))


@pytest.fixture
def hub_repo(tmp_path):
    repo = tmp_path / "hub" / "acme" / "tiny-llama"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps(CONFIG))
    _random_file(repo / "model-00001-of-00003.safetensors", 210 * MB)
    _random_file(repo / "model-00002-of-00003.safetensors", 12 * MB)
    _random_file(repo / "model-00003-of-00003.safetensors", 3 * MB)
    with serve(tmp_path / "hub") as url:
        yield url, repo


@pytest.mark.timeout(300)
def test_a_download_killed_midway_resumes_after_the_agent_restarts_and_verifies(
        logged_in_page, hub_repo, process_env, spawn, unique, tmp_path, settings):
    url, source = hub_repo
    settings.HF_ENDPOINT = url
    env = dict(process_env, HF_ENDPOINT=url)
    store = tmp_path / "store"
    name = f"dl-{unique}"
    argv = agent_argv(name, store, sample_seconds=0.5, heartbeat_seconds=1)
    agent = spawn(argv, env, name=name)
    node = wait_until(lambda: Node.objects.filter(name=name, disk_total__gt=0).first(), timeout=60, message="the agent")

    model = ModelRepo.objects.create(repo_id="acme/tiny-llama")
    in_thread(repos.model_inspect, model.pk)
    model.refresh_from_db()
    assert model.attention == "gqa" and model.total_size > 225 * MB

    page = logged_in_page
    page.goto(f"{page.base_url}/models/{model.pk}/")
    expect(page.locator("#architecture")).to_have_text("LlamaForCausalLM")
    configure(url, throttle_bps=25 * MB)
    page.select_option("#download-form select[name=node]", str(node.pk))
    page.click("#download-form button[type=submit]")
    card = page.locator(".copy").first
    expect(card.locator('[data-f="state"]')).to_have_text("Downloading", timeout=30000)
    expect(card.locator('[data-f="text"]')).to_contain_text("MiB/s", timeout=30000)

    copy = ModelCopy.objects.get(model=model, node=node)
    dest = Path(store) / "acme--tiny-llama"
    wait_until(lambda: _on_disk(dest) > 80 * MB, timeout=60, message="the big file to be partway")
    os.killpg(agent.pid, signal.SIGKILL)
    agent.wait(10)
    kept = _on_disk(dest)
    remaining = model.total_size - kept
    assert 0 < remaining < model.total_size
    assert not (dest / "model-00001-of-00003.safetensors").exists()  # never under its final name half-written
    reset_stats(url)

    spawn(argv, env, name=name + "-again")
    wait_until(lambda: ModelCopy.objects.get(pk=copy.pk).state == "ready", timeout=120, message="the resumed download")
    fetched_after = get_stats(url)["total"]
    print(f"resume: {kept} bytes kept at the kill, {remaining} remaining, {fetched_after} fetched after the restart")
    assert fetched_after <= remaining * 1.10, f"re-fetched {fetched_after} bytes for {remaining} remaining"
    for path in sorted(p for p in source.iterdir() if p.is_file()):
        assert _sha(dest / path.name) == _sha(path), path.name
    assert not list((dest / downloads.PARTIAL_DIR).rglob("*.part"))
    expect(card.locator('[data-f="state"]')).to_have_text("Ready", timeout=15000)
    expect(card.locator('[data-f="bar"]')).to_have_attribute("style", re.compile(r"width: 100(\.0)?%"))


@pytest.mark.timeout(300)
def test_stopping_a_deployment_while_it_prepares_cancels_the_download_its_plan_started(
        hub_repo, process_env, spawn, unique, tmp_path, settings, operator):
    """A real agent's plan downloads the model (throttled); a Stop while it prepares cancels that download
    within seconds, keeps what was fetched for a retry, and the hub serves no more."""
    url, _ = hub_repo
    settings.HF_ENDPOINT = url
    env = dict(process_env, HF_ENDPOINT=url, CPU_HOST_EXCLUSIVE="0")  # other sessions here run engines of their own
    name = f"dl-{unique}"
    spawn(agent_argv(name, tmp_path / "store", sample_seconds=0.5, heartbeat_seconds=1), env, name=name)
    node = wait_until(lambda: Node.objects.filter(name=name, disk_total__gt=0, ram_total__gt=0).first(), timeout=60,
                      message="the agent")
    model = ModelRepo.objects.create(repo_id="acme/tiny-llama")
    model = in_thread(repos.model_inspect, model.pk)
    configure(url, throttle_bps=4 * MB)  # the 225 MB take about a minute: the Stop lands mid-way

    d = in_thread(deploys.deployment_create, model=model, node=node, gpu_indices=[], port=None, engine_args={}, env={},
                  user=operator, preset="auto")
    copy = wait_until(lambda: ModelCopy.objects.filter(model=model, node=node, state="downloading", bytes_done__gt=4 * MB,
                                                       progress__deployment=d.pk).first(),
                      timeout=60, message="the plan's download to be under way")
    in_thread(deploys.deployment_stop, d)
    wait_until(lambda: ModelCopy.objects.get(pk=copy.pk).state == "cancelled", timeout=15, message="the download cancelled")
    served = get_stats(url)["total"]
    wait_until(lambda: Deployment.objects.get(pk=d.pk).status in Deployment.TERMINAL, timeout=30, message="the stop")
    time.sleep(2)  # a download still running would fetch ~8 MB more meanwhile
    after = get_stats(url)["total"]
    kept = ModelCopy.objects.get(pk=copy.pk)
    print(f"cancelled at {kept.bytes_done} of {kept.bytes_total} bytes; served {served} then {after}")
    assert after - served < 1 * MB and 0 < kept.bytes_done < kept.bytes_total
    assert Deployment.objects.get(pk=d.pk).status == Deployment.Status.STOPPED
    assert "Cancelled the download of acme/tiny-llama" in Deployment.objects.get(pk=d.pk).events.get(step="stop").message
