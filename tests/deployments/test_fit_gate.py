"""The fit verdict gates a deploy, and a deployment's stop cancels the download its plan started."""
import json
from pathlib import Path
from unittest import mock

import pytest
from django.utils import timezone

from deployments.host import downloads
from deployments.models import Deployment, ModelCopy
from deployments import modelcopies
from deployments.services import deploys, fitgate, repos
from plumbing.errors import ServiceError
from tests.factories import DeploymentFactory, GpuFactory, ModelRepoFactory, NodeFactory
from tests.hfserver import serve

pytestmark = pytest.mark.django_db
CONFIGS = Path(__file__).resolve().parent.parent / "fixtures" / "configs"
GiB = 2**30
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _cpu_model(weights_gib: float):
    return ModelRepoFactory(files=[{"path": "model.safetensors", "size": int(weights_gib * GiB)}],
                            total_size=int(weights_gib * GiB))


def _cpu_node(ram_gib=24, cores=2):
    return NodeFactory(ram_total=ram_gib * GiB, cpu_count=cores)


def test_a_model_too_big_for_the_cpu_nodes_ram_is_refused_naming_the_figures():
    model, node = _cpu_model(30), _cpu_node()
    with pytest.raises(ServiceError) as refused:
        fitgate.model_fit_gate(model, node, [], {}, CPU_ENV)
    assert refused.value.code == "does_not_fit" and refused.value.field == "model"
    message = refused.value.message
    assert f"{model} does not fit {node}: needs ~34.0 GiB of RAM" in message and "the host has 24.0 GiB" in message
    assert "smaller model" in message and "--override-fit" in message


def test_the_cpu_kv_cache_the_deploy_asks_for_counts():
    model, node = _cpu_model(2), _cpu_node()
    assert fitgate.model_fit_gate(model, node, [], {}, CPU_ENV) is None  # 2 + 1 + 3 GiB in 24
    with pytest.raises(ServiceError, match="KV cache 30.0 GiB"):
        fitgate.model_fit_gate(model, node, [], {}, {"VLLM_CPU_KVCACHE_SPACE": "30"})


def test_an_unknown_verdict_and_a_multi_node_deploy_pass():
    assert fitgate.model_fit_gate(_cpu_model(30), NodeFactory(ram_total=0), [], {}, CPU_ENV) is None  # RAM not reported
    assert fitgate.model_fit_gate(ModelRepoFactory(config={}), GpuFactory().node, [0], {}, {}) is None  # config not read
    assert fitgate.model_fit_gate(_cpu_model(30), _cpu_node(), [], {}, CPU_ENV, nnodes=2) is None


def test_only_an_admin_overrides_and_the_override_says_what_it_overrode():
    model, node = _cpu_model(30), _cpu_node()
    with pytest.raises(ServiceError) as refused:
        fitgate.model_fit_gate(model, node, [], {}, CPU_ENV, override=True, admin=False)
    assert refused.value.code == "forbidden"
    override = fitgate.model_fit_gate(model, node, [], {}, CPU_ENV, override=True, admin=True)
    assert override.message.startswith("Deployed although the fit check says does not fit: needs ~34.0 GiB")
    assert override.data == {"verdict": override.data["verdict"]} and "an admin overrode" in override.message


def test_a_redeploy_keeps_an_earlier_override_of_the_same_verdict_only():
    model, node = _cpu_model(30), _cpu_node()
    d = DeploymentFactory(model=model, node=node, status=Deployment.Status.STOPPED)
    verdict = fitgate.deploy_fit(model, node, [], {}, CPU_ENV).message
    d.events.create(step="fit_override", message="…", data={"verdict": verdict})
    kept = fitgate.model_fit_gate(model, node, [], {}, CPU_ENV, deployment=d)
    assert "kept from an earlier admin override" in kept.message
    with pytest.raises(ServiceError, match="does not fit"):  # another verdict: asked again
        fitgate.model_fit_gate(model, node, [], {}, {"VLLM_CPU_KVCACHE_SPACE": "4"}, deployment=d)


def _gpu_model():
    config = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    return ModelRepoFactory(config=config, files=[{"path": "model.safetensors", "size": 700 * 10**9}], total_size=700 * 10**9)


def test_a_gpu_deploy_is_weighed_on_the_chosen_gpus_at_its_own_tp():
    model = _gpu_model()
    node = NodeFactory()
    for i in range(8):
        GpuFactory(node=node, index=i, memory_total=141 * 10**9)
    with pytest.raises(ServiceError) as refused:  # TP 4 on 4 GPUs: 700 GB of weights on 4 × 141 GB
        fitgate.model_fit_gate(model, node, [0, 1, 2, 3], {"tensor-parallel-size": 4}, {})
    assert "does not fit" in refused.value.message and "more GPUs" in refused.value.message
    assert fitgate.model_fit_gate(model, node, list(range(8)), {"tensor-parallel-size": 8}, {}) is None


def test_a_kv_cache_shorter_than_the_context_asks_for_a_lower_max_model_len():
    model = _gpu_model()
    node = NodeFactory()
    for i in range(8):
        GpuFactory(node=node, index=i, memory_total=141 * 10**9)
    args = {"tensor-parallel-size": 8, "gpu-memory-utilization": 0.7}
    fit = fitgate.deploy_fit(model, node, list(range(8)), args, {})
    if fit.fits:  # the estimate leaves room at 0.7: make the context longer than the cache instead
        args["max-model-len"] = fit.kv_tokens + 1
        fit = fitgate.deploy_fit(model, node, list(range(8)), args, {})
    assert not fit.fits and fit.kv_tokens
    with pytest.raises(ServiceError, match=f"max model length of at most {fit.kv_tokens:,}"):
        fitgate.model_fit_gate(model, node, list(range(8)), args, {})
    assert fitgate.model_fit_gate(model, node, list(range(8)), {**args, "max-model-len": fit.kv_tokens}, {}) is None


# --- a stop cancels the download its plan started -----------------------------------------------

def _downloading(deployment=None, **progress):
    model = _cpu_model(10)
    node = _cpu_node()
    copy = ModelCopy.objects.create(model=model, node=node, state="downloading", bytes_done=3 * GiB,
                                    bytes_total=10 * GiB, progress={**progress, **({"deployment": deployment} if deployment else {})})
    return copy


def test_a_stop_cancels_the_download_the_plan_started_and_says_so():
    copy = _downloading()
    d = DeploymentFactory(model=copy.model, node=copy.node, status=Deployment.Status.PREPARING)
    ModelCopy.objects.filter(pk=copy.pk).update(progress={"deployment": d.pk})
    assert repos.model_download_cancel_for(d) == [
        f"Cancelled the download of {copy.model} to {copy.node} it started (3.0 GiB kept for a retry)."]
    copy.refresh_from_db()
    assert copy.cancel_requested and copy.state == "downloading"  # the download itself stops at its next chunk


def test_a_download_a_user_started_goes_on_when_a_deploy_waiting_for_it_stops():
    copy = _downloading()
    d = DeploymentFactory(model=copy.model, node=copy.node, status=Deployment.Status.PREPARING)
    assert repos.model_download_cancel_for(d) == []
    copy.refresh_from_db()
    assert not copy.cancel_requested


def test_deleting_a_failed_deployment_cancels_the_download_its_plan_started_and_leaves_a_users_alone():
    """A plan that failed (its node lost the engine, say) while its download went on: Delete stops that download."""
    copy = _downloading()
    d = DeploymentFactory(model=copy.model, node=copy.node, status=Deployment.Status.FAILED)
    ModelCopy.objects.filter(pk=copy.pk).update(progress={"deployment": d.pk})
    users = ModelCopy.objects.create(model=copy.model, node=NodeFactory(), state="downloading", bytes_done=GiB,
                                     bytes_total=10 * GiB)
    assert deploys.deployment_delete(d) is True
    assert not Deployment.objects.filter(pk=d.pk).exists()
    assert ModelCopy.objects.get(pk=copy.pk).cancel_requested
    assert not ModelCopy.objects.get(pk=users.pk).cancel_requested


@pytest.fixture
def download():
    with mock.patch("deployments.host.downloads.download", autospec=True) as fn:
        yield fn


def _queued_for(tmp_path, status):
    model = _cpu_model(10)
    model.files = [{"path": "model.safetensors", "size": 10 * GiB, "sha256": "a" * 64, "blob_id": "b" * 40}]
    model.commit, model.inspected = "f" * 40, timezone.now()
    model.save()
    node = NodeFactory(model_store=str(tmp_path))
    d = DeploymentFactory(model=model, node=node, status=status)
    copy = ModelCopy.objects.create(model=model, node=node, state="queued", bytes_total=model.total_size)
    return d, copy


@pytest.mark.parametrize("status, cancelled", [(Deployment.Status.PREPARING, False), (Deployment.Status.STOPPING, True),
                                               (Deployment.Status.STOPPED, True)])
def test_a_plans_download_stops_itself_once_its_deployment_no_longer_wants_it(tmp_path, download, status, cancelled):
    d, copy = _queued_for(tmp_path, status)
    asked = []

    def fake_download(info, dest, token, endpoint, on_progress, should_cancel):
        assert ModelCopy.objects.get(pk=copy.pk).progress["deployment"] == d.pk  # recorded before the first byte
        on_progress(downloads.Progress(GiB, info.total_size, {"model.safetensors": (GiB, 10 * GiB)}, 1e8, 90.0,
                                       "model.safetensors"))
        asked.append(should_cancel())
        assert ModelCopy.objects.get(pk=copy.pk).progress["deployment"] == d.pk  # progress keeps the mark
        if should_cancel():
            raise downloads.DownloadCancelled()

    download.side_effect = fake_download
    with mock.patch("deployments.host.disk.disk_usage", autospec=True) as usage:
        usage.return_value = mock.Mock(total=100 * GiB, free=50 * GiB)
        modelcopies.model_copy_download(copy.pk, deployment_id=d.pk)
    assert asked == [cancelled]
    assert ModelCopy.objects.get(pk=copy.pk).state == ("cancelled" if cancelled else "ready")


def test_a_users_download_again_is_no_longer_the_plans(tmp_path, sent_tasks):
    d, copy = _queued_for(tmp_path, Deployment.Status.STOPPED)
    ModelCopy.objects.filter(pk=copy.pk).update(state="cancelled", progress={"deployment": d.pk})
    copy = repos.model_download(copy.model, copy.node)
    assert "deployment" not in copy.progress


def test_a_model_the_hub_lists_too_big_is_refused_after_a_real_inspection(tmp_path, settings, sent_tasks):
    """Through the hub client against the test hub: a Git LFS pointer stands for 40 GiB of weights."""
    repo = tmp_path / "hub" / "acme" / "huge-chat"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (repo / "model.safetensors").write_text(f"version https://git-lfs.github.com/spec/v1\noid sha256:{'0' * 64}\n"
                                            f"size {40 * GiB}\n")
    with serve(tmp_path / "hub") as url:
        settings.HF_ENDPOINT = url
        model = repos.model_inspect(repos.model_add("acme/huge-chat").pk)
    assert [(f["path"], f["size"], f["sha256"]) for f in model.files if f["path"].endswith(".safetensors")] == [
        ("model.safetensors", 40 * GiB, "0" * 64)]
    with pytest.raises(ServiceError, match="needs ~44.0 GiB of RAM"):
        fitgate.model_fit_gate(model, _cpu_node(), [], {}, CPU_ENV)
