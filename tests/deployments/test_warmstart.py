"""Warm starts: a remembered memory profile reused or refused (the deploy service, the API, the node's launch), what a
load records of its start, and the compile caches going with a deleted model copy."""
import os
from pathlib import Path
from unittest import mock

import factory
import pytest
from django.utils import timezone

from deployments import warmstart
from deployments.contextfit import EngineKv
from deployments.forms import DeployForm
from deployments.host import compilecache, osuser
from deployments.models import Deployment, DeploymentEvent, ModelCopy
from deployments.services import deploys, repos
from plumbing.errors import ServiceError
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory

pytestmark = pytest.mark.django_db
ARGS = {"tensor-parallel-size": 1, "max-model-len": 4096}
KV = 37 * 2**30
OWN = osuser.EngineUser(name="me", uid=os.getuid(), gid=os.getgid(), separate=False)


@pytest.fixture
def node(tmp_path):
    """A node with two GPUs of known UUIDs, its engine's version reported, and the model store in tmp_path."""
    node = NodeFactory(name="gpu-01", model_store=str(tmp_path), engine_version="0.32.0")
    GpuFactory.create_batch(2, node=node, index=factory.Iterator([0, 1]), uuid=factory.Iterator(["GPU-aaaa-0", "GPU-aaaa-1"]))
    return node


@pytest.fixture
def model(node, tmp_path):
    return ModelCopyFactory(node=node, path=str(tmp_path / "org--m"), model__files=[{"path": "a", "size": 1}]).model


def _loaded(model, node, gpus=(0,), args=ARGS, kv=KV) -> DeploymentEvent:
    """A finished load of `model` on `node` that recorded its profile, as LoadWatch.finish does."""
    d = DeploymentFactory(model=model, node=node, engine_args=args, status=Deployment.Status.STOPPED)
    d.gpus.set(node.gpus.filter(index__in=gpus))
    engine_kv = EngineKv(device="GPU", tokens=300_000, kv_bytes=kv)
    data = {"totals": {"weights": 10.0}, "model": model.pk, **warmstart.load_data(d, {}, compilecache.HitWatch(), engine_kv)}
    return DeploymentEvent.objects.create(deployment=d, step="load", ended=timezone.now(), data=data)


def test_a_matching_profile_is_reused(model, node):
    _loaded(model, node)
    assert warmstart.reusable_profile(model, node, [0], ARGS, {}) == KV


def test_a_reused_profile_is_refused_when_the_gpus_changed(model, node):
    _loaded(model, node, gpus=(0,))
    with pytest.raises(warmstart.ProfileRefused, match=r"the GPUs changed \(GPU-aaaa-0 then, GPU-aaaa-1 now\)"):
        warmstart.reusable_profile(model, node, [1], ARGS, {})


def test_a_reused_profile_is_refused_when_the_settings_or_the_engine_changed(model, node):
    _loaded(model, node)
    with pytest.raises(warmstart.ProfileRefused, match="settings that shape the graph or the memory changed"):
        warmstart.reusable_profile(model, node, [0], {**ARGS, "gpu-memory-utilization": 0.5}, {})
    node.engine_version = "0.33.0"
    with pytest.raises(warmstart.ProfileRefused, match=r"engine version changed \(0.32.0 then, 0.33.0 now\)"):
        warmstart.reusable_profile(model, node, [0], ARGS, {})


def test_without_an_earlier_load_there_is_no_profile_to_reuse(model, node):
    with pytest.raises(warmstart.ProfileRefused, match="No earlier load"):
        warmstart.reusable_profile(model, node, [0], ARGS, {})


def test_the_deploy_service_refuses_a_reused_profile_after_a_gpu_change(model, node, sent_tasks):
    _loaded(model, node, gpus=(0,))
    with pytest.raises(ServiceError) as refused:
        deploys.deployment_create(model=model, node=node, gpu_indices=[1], port=8000, engine_args=ARGS, env={},
                                  reuse_memory_profile=True)
    assert refused.value.code == "no_memory_profile" and "GPUs changed" in str(refused.value)
    assert not Deployment.objects.filter(port=8000).exists()
    d = deploys.deployment_create(model=model, node=node, gpu_indices=[0], port=8000, engine_args=ARGS, env={},
                                  reuse_memory_profile=True)
    assert d.reuse_memory_profile


def test_the_api_takes_the_option_and_refuses_it_when_no_profile_matches(api, model, node, sent_tasks):
    body = {"model": model.pk, "node": "gpu-01", "gpus": [0], "preset": "none", "engine_args": ARGS,
            "reuse_memory_profile": True}
    refused = api.post("/api/deployments/", body, format="json")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "no_memory_profile"
    _loaded(model, node)
    accepted = api.post("/api/deployments/", body, format="json")
    assert accepted.status_code == 202 and accepted.json()["reuse_memory_profile"] is True


def test_the_deploy_form_offers_the_option():
    assert "reuse_memory_profile" in DeployForm.base_fields
    assert "memory profile" in DeployForm.base_fields["reuse_memory_profile"].label


def test_the_node_launch_passes_the_profile_and_the_cache_folder(model, node, tmp_path):
    _loaded(model, node)
    d = DeploymentFactory(model=model, node=node, engine_args=ARGS, reuse_memory_profile=True)
    d.gpus.set(node.gpus.filter(index=0))
    args, env, start = warmstart.launch_prepare(d, str(tmp_path / "org--m"), OWN)
    assert args == {"kv-cache-memory-bytes": KV} and start["profile_reused"] == KV
    assert Path(env["VLLM_CACHE_ROOT"]).parent == tmp_path / ".compile-cache" / "org--m"
    assert start["compile_cache"]["managed"] and not start["compile_cache"]["folder_warm"]
    d.gpus.set(node.gpus.filter(index=1))  # the node checks again: the GPUs changed since the deploy was accepted
    with pytest.raises(warmstart.ProfileRefused, match="GPUs changed"):
        warmstart.launch_prepare(d, str(tmp_path / "org--m"), OWN)


def test_a_load_records_whether_its_start_was_cold_or_warm_and_why(model, node, tmp_path):
    d = DeploymentFactory(model=model, node=node, engine_args=ARGS)
    d.gpus.set(node.gpus.filter(index=0))
    _, _, start = warmstart.launch_prepare(d, str(tmp_path / "org--m"), OWN)
    miss, hit = compilecache.HitWatch(), compilecache.HitWatch()
    miss.feed("INFO [backends.py:399] Compiling a graph for compile range (1, 8192) takes 21.37 s")
    hit.feed("INFO [backends.py:296] Directly load the compiled graph(s) for compile range (1, 8192) from the cache")
    kv = EngineKv(device="GPU", tokens=1000, kv_bytes=KV)
    cold = warmstart.load_data(d, start, miss, kv)
    assert (cold["start"], cold["warm_by"], cold["compile_cache"]["verdict"]) == ("cold", [], "miss")
    assert cold["profile"] == {"kv_bytes": KV, "kv_tokens": 1000, "gpus": ["GPU-aaaa-0"], "engine": "0.32.0",
                               "settings": warmstart.profile_settings_key(ARGS, {})}
    warm = warmstart.load_data(d, {**start, "profile_reused": KV}, hit, EngineKv())
    assert (warm["start"], warm["warm_by"]) == ("warm", ["compile cache", "memory profile"])
    assert warm["profile"]["kv_bytes"] == KV  # the reused size, recorded for the next start


def test_deleting_a_copy_removes_its_compile_caches(model, node, tmp_path):
    copy = ModelCopy.objects.get(model=model, node=node)
    (tmp_path / "org--m").mkdir()
    ours = Path(compilecache.prepare(tmp_path, copy.path, "k1", OWN).path)
    (ours / "artifact").write_bytes(b"x" * 100)
    theirs = Path(compilecache.prepare(tmp_path, tmp_path / "org--other", "k1", OWN).path)
    (theirs / "artifact").write_bytes(b"x")
    copy.state = ModelCopy.State.DELETING
    copy.save()
    with mock.patch("deployments.services.repos.node_refresh_disk", autospec=True):
        freed = repos.model_copy_remove(copy.pk)
    assert freed >= 100
    assert not ours.parent.exists() and (theirs / "artifact").exists()
    assert not ModelCopy.objects.filter(pk=copy.pk).exists()


def test_the_pages_show_each_start_and_the_models_compile_cache(operator_client, model, node, tmp_path):
    event = _loaded(model, node)
    event.data.update(start="warm", warm_by=["compile cache"],
                      compile_cache={"managed": True, "verdict": "hit", "bytes": 3 * 2**20, "model_bytes": 5 * 2**20})
    event.save()
    page = operator_client.get(f"/deployments/{event.deployment_id}/").content.decode()
    assert 'data-start="warm"' in page and "compile cache" in page and "hit · 3.0 MiB" in page
    page = operator_client.get(f"/models/{model.pk}/").content.decode()
    assert "Compile cache: 5.0 MiB; the last start used it (hit), warm start." in page


def test_panelctl_deploy_sends_the_option_and_says_why_it_is_refused(live_server_asgi, operator, model, node, capsys, sent_tasks):
    from panelctl import cli
    from plumbing import tokens

    login = ["--url", live_server_asgi, "--token", tokens.issue(operator)]
    code = cli.main([*login, "deploy", str(model.pk), "--node", "gpu-01", "--gpus", "0", "--reuse-memory-profile"])
    assert code != 0 and "recorded a memory profile" in capsys.readouterr().err
    assert not Deployment.objects.exists()


def test_a_runs_environment_says_whether_its_engine_started_cold_or_warm(model, node):
    from benchmarks.selectors import startup_text
    from deployments.selectors import deployment_startup

    event = _loaded(model, node)
    event.data.update(start="warm", warm_by=["compile cache", "memory profile"], totals={"weights": 2.0, "compile": 4.5})
    event.save()
    snapshot = deployment_startup(event.deployment)
    assert snapshot["start"] == "warm" and snapshot["warm_by"] == ["compile cache", "memory profile"]
    text = startup_text({"startup": snapshot})  # PostgreSQL's jsonb keeps the phases in an order of its own
    assert text.startswith("ready in 6.5 s, warm: compile cache + memory profile (")
    assert "weights 2.0 s" in text and "compile 4.5 s" in text


def test_a_cpu_node_is_not_offered_sleep_mode_start_asleep_or_a_memory_profile():
    """The deploy form offered sleep mode, start asleep and memory-profile reuse on a CPU node (all three CUDA's)."""
    from tests.factories import GpuFactory, NodeFactory

    cpu, gpu = NodeFactory(name="cpu-only"), NodeFactory(name="gpu-node")
    GpuFactory(node=gpu, index=0)
    for name in ("sleep_mode", "start_asleep", "reuse_memory_profile"):
        assert DeployForm(node=cpu)[name].is_hidden and not DeployForm(node=gpu)[name].is_hidden
