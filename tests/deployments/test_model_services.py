"""Models and downloads, with the Hub replaced at the host/hub.py boundary."""
import json
import os
from pathlib import Path
from unittest import mock

import pytest

from deployments.host import downloads, hub, osuser
from deployments.models import ModelCopy, ModelRepo, Secret
from deployments import modelcopies
from deployments.services import fitgate, repos
from plumbing.errors import ServiceError
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db
CONFIGS = Path(__file__).resolve().parent.parent / "fixtures" / "configs"
GiB = 2**30


def _info(config_name="deepseek-v3.json", shard_gb=(5, 5)):
    files = [hub.RepoFile(f"model-{i:05d}.safetensors", int(gb * GiB), "a" * 64, "b" * 40) for i, gb in enumerate(shard_gb)]
    files.append(hub.RepoFile("config.json", 1000, None, "c" * 40))
    return hub.RepoInfo("org/model", "main", "f" * 40, files, json.loads((CONFIGS / config_name).read_text()),
                        sum(f.size for f in files))


@pytest.fixture
def repo_info():
    with mock.patch("deployments.host.hub.repo_info", autospec=True) as fn:
        fn.return_value = _info()
        yield fn


@pytest.fixture
def download():
    with mock.patch("deployments.host.downloads.download", autospec=True) as fn:
        yield fn


def _inspected(**kwargs):
    model = ModelRepoFactory(repo_id="org/model", **kwargs)
    with mock.patch("deployments.host.hub.repo_info", autospec=True, return_value=_info()):
        return repos.model_inspect(model.pk)


def test_inspect_records_files_commit_and_what_the_config_says(repo_info):
    model = ModelRepoFactory(repo_id="org/model", total_size=0)
    repos.model_inspect(model.pk)
    model.refresh_from_db()
    assert model.commit == "f" * 40 and len(model.files) == 3 and model.total_size == 10 * GiB + 1000
    assert (model.architecture, model.attention, model.num_layers, model.hidden_size) == ("DeepseekV3ForCausalLM", "mla", 61, 7168)
    assert (model.num_experts, model.num_shared_experts, model.experts_per_token) == (256, 1, 8)
    assert model.quant_method == "fp8" and model.kv_lora_rank == 512
    assert 660e9 < model.num_parameters < 690e9 and model.inspected


def test_an_unknown_repo_leaves_a_clear_message_and_is_not_retried(repo_info):
    repo_info.side_effect = hub.HubError("Repository org/nope was not found on https://hub.", True, "not_found")
    model = ModelRepoFactory(repo_id="org/nope")
    repos.model_inspect(model.pk)
    model.refresh_from_db()
    assert model.inspect_error == "Repository org/nope was not found on https://hub." and not model.inspected


def test_an_unreachable_hub_is_raised_so_the_task_retries(repo_info):
    repo_info.side_effect = hub.HubError("Cannot reach the Hub.", False, "unavailable")
    with pytest.raises(hub.HubError):
        repos.model_inspect(ModelRepoFactory().pk)


def test_the_token_comes_from_the_panel_setting_and_is_passed_only_to_the_hub(repo_info):
    repos.hf_token_set("hf_secret_value")
    repos.model_inspect(ModelRepoFactory().pk)
    assert repo_info.call_args.kwargs["token"] == "hf_secret_value"
    assert "hf_secret_value" not in repr(Secret.objects.get()) + str(Secret.objects.get())
    repos.hf_token_set("")
    assert modelcopies.hf_token() == ""


def test_download_refuses_before_the_first_byte_when_the_disk_is_short_and_lists_what_to_delete(sent_tasks):
    model = _inspected()
    node = NodeFactory(disk_total=20 * GiB, disk_free=3 * GiB)
    idle = ModelCopyFactory(node=node, bytes_done=7 * GiB)
    busy = ModelCopyFactory(node=node, bytes_done=2 * GiB)
    DeploymentFactory(node=node, model=busy.model, status="ready")
    with pytest.raises(repos.DiskShort) as short:
        repos.model_download(model, node)
    assert "needs 10.0 GiB, has 3.0 GiB free" in short.value.message
    assert [(c["id"], c["in_use"]) for c in short.value.candidates] == [(idle.pk, False), (busy.pk, True)]
    assert not sent_tasks.commit()
    assert not ModelCopy.objects.filter(model=model, state="queued").exists()


def test_download_is_queued_on_the_nodes_own_queue(sent_tasks):
    model = _inspected()
    node = NodeFactory(disk_total=100 * GiB, disk_free=50 * GiB)
    copy = repos.model_download(model, node)
    assert copy.state == "queued" and copy.bytes_total == model.total_size
    download = sent_tasks.commit().one("deployments.model_copy_download")
    assert (download.args, download.queue) == ([copy.pk], node.queue)
    with pytest.raises(ServiceError, match="already queued"):
        repos.model_download(model, node)


def test_download_of_a_model_not_yet_read_is_refused(sent_tasks):
    with pytest.raises(ServiceError, match="not been inspected"):
        repos.model_download(ModelRepoFactory(), NodeFactory())


def _queued_copy(tmp_path):
    model = _inspected()
    node = NodeFactory(model_store=str(tmp_path), disk_total=100 * GiB, disk_free=50 * GiB)
    return ModelCopy.objects.create(model=model, node=node, state="queued", bytes_total=model.total_size)


def test_a_download_records_progress_and_ends_ready(tmp_path, download):
    copy = _queued_copy(tmp_path)

    def fake_download(info, dest, token, endpoint, on_progress, should_cancel):
        assert dest == tmp_path / "org--model" and info.commit == "f" * 40
        on_progress(downloads.Progress(4 * GiB, info.total_size, {"model-00000.safetensors": (4 * GiB, 5 * GiB)}, 2e8, 30.0, "model-00000.safetensors"))
        seen = ModelCopy.objects.get(pk=copy.pk)
        assert seen.bytes_done == 4 * GiB and seen.rate == 2e8
        assert seen.progress["files"]["model-00000.safetensors"] == [4 * GiB, 5 * GiB]

    download.side_effect = fake_download
    with mock.patch("deployments.host.disk.disk_usage", autospec=True) as usage:
        usage.return_value = mock.Mock(total=100 * GiB, free=50 * GiB)
        modelcopies.model_copy_download(copy.pk)
    copy.refresh_from_db()
    assert copy.state == "ready" and copy.bytes_done == copy.bytes_total and copy.path == str(tmp_path / "org--model")


def test_the_agent_checks_the_real_disk_before_the_first_byte(tmp_path, download):
    copy = _queued_copy(tmp_path)
    with mock.patch("deployments.host.disk.disk_usage", autospec=True) as usage:
        usage.return_value = mock.Mock(total=100 * GiB, free=1 * GiB)
        modelcopies.model_copy_download(copy.pk)
    download.assert_not_called()
    copy.refresh_from_db()
    assert copy.state == "failed" and copy.error_code == "disk_full"
    assert "needs 10.0 GiB, has 1.0 GiB free" in copy.error


@pytest.mark.parametrize("error, state", [
    (hub.HubError("No space left on device while writing model.safetensors", True, "disk_full"), "failed"),
    (hub.HubError("Access to org/model is restricted: a token with access is needed.", True, "gated"), "failed"),
    (downloads.DownloadCancelled(), "cancelled"),
])
def test_a_failed_or_cancelled_download_says_why_and_keeps_its_place(tmp_path, download, error, state):
    copy = _queued_copy(tmp_path)
    download.side_effect = error
    modelcopies.model_copy_download(copy.pk)
    copy.refresh_from_db()
    assert copy.state == state
    if state == "failed":
        assert copy.error == error.message
    assert not copy.cancel_requested


def test_a_redelivered_task_leaves_a_running_download_alone(tmp_path, download):
    copy = _queued_copy(tmp_path)
    download.side_effect = hub.HubError("Another download into ... is running.", False, "busy")
    modelcopies.model_copy_download(copy.pk)
    assert ModelCopy.objects.get(pk=copy.pk).state == "downloading"


def test_cancel_then_retry_resumes(tmp_path, sent_tasks):
    copy = _queued_copy(tmp_path)
    ModelCopy.objects.filter(pk=copy.pk).update(state="downloading", bytes_done=GiB)
    copy = repos.model_copy_cancel(copy)
    assert copy.cancel_requested and copy.state == "downloading"  # the agent stops at its next check
    ModelCopy.objects.filter(pk=copy.pk).update(state="cancelled")
    copy.refresh_from_db()
    copy = repos.model_copy_retry(copy)
    assert copy.state == "queued" and copy.bytes_done == GiB and not copy.cancel_requested


def test_a_copy_in_use_by_a_running_deployment_cannot_be_deleted(sent_tasks):
    copy = ModelCopyFactory()
    DeploymentFactory(node=copy.node, model=copy.model, status="loading", name="kimi-prod")
    with pytest.raises(ServiceError, match="in use .* by kimi-prod"):
        repos.model_copy_delete(copy)
    assert ModelCopy.objects.get(pk=copy.pk).state == "ready"


def test_delete_removes_the_files_inside_the_store_only(tmp_path, sent_tasks):
    store = tmp_path / "store"
    folder = store / "org--model"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"x" * 1000)
    copy = ModelCopyFactory(node=NodeFactory(model_store=str(store)), path=str(folder))
    repos.model_copy_delete(copy)
    assert ModelCopy.objects.get(pk=copy.pk).state == "deleting"
    assert repos.model_copy_remove(copy.pk) == 1000
    assert not folder.exists() and not ModelCopy.objects.filter(pk=copy.pk).exists()
    outside = ModelCopyFactory(node=NodeFactory(model_store=str(store)), path=str(tmp_path), state="deleting")
    with pytest.raises(Exception, match="not inside the model store"):
        repos.model_copy_remove(outside.pk)
    assert tmp_path.exists()


def test_an_agent_restart_queues_its_unfinished_downloads_again(sent_tasks):
    node = NodeFactory()
    running = ModelCopyFactory(node=node, state="downloading")
    ModelCopyFactory(node=node, state="ready")
    ModelCopyFactory(node=node, state="failed")
    assert repos.model_copies_resume(node) == [running.pk]


def test_a_local_folder_becomes_a_ready_copy_on_its_node(tmp_path, settings, monkeypatch):
    settings.LOCAL_MODEL_ROOTS = [str(tmp_path)]
    monkeypatch.setattr(osuser, "current", lambda: osuser.EngineUser("me", os.getuid(), os.getgid(), separate=False))
    (tmp_path / "config.json").write_text((CONFIGS / "llama-3.1-8b-instruct.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    node = NodeFactory()
    model = ModelRepo.objects.create(repo_id="local/m", revision="x", local_path=str(tmp_path))
    repos.model_inspect_local(model.pk, node.pk)
    model.refresh_from_db()
    assert model.attention == "gqa" and model.num_kv_heads == 8 and model.total_size > 4096
    assert ModelCopy.objects.get(model=model, node=node).state == "ready"


def test_fit_check_uses_the_nodes_gpus(sent_tasks):
    model = _inspected()
    node = NodeFactory()
    for i in range(8):
        GpuFactory(node=node, index=i, memory_total=141 * GiB)
    fit = fitgate.model_fit(model, node, tp=8)
    assert fit.fits and "tokens of KV cache at TP=8" in fit.message
    assert not fitgate.model_fit(model, node, tp=16).fits
