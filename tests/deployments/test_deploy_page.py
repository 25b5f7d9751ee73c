"""The deploy page: Deploy off while the fit check says the model will not fit, an admin's override,
"Check fit" for changed values, only the fields that apply to the node, how much context the chosen layout
holds, and the host checks that layout depends on."""
import re

import pytest
from django.urls import reverse

from deployments.models import Deployment
from tests.deployments.test_doctor_service import facts as doctor_facts, run_on
from tests.deployments.test_recipe_deploy import KIMI_FLAGS, _config as kimi_config, _kimi_id as kimi_recipe_id
from tests.factories import GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.django_db
GiB = 2**30


def _cpu(weights_gib: float):
    node = NodeFactory(name="cpu-01", ram_total=24 * GiB, cpu_count=2)
    model = ModelRepoFactory(repo_id="acme/big", files=[{"path": "model.safetensors", "size": int(weights_gib * GiB)}],
                             total_size=int(weights_gib * GiB))
    ModelCopyFactory(model=model, node=node, path="/models/big")
    return model, node


def _page(client, model, node, query="", **data):
    url = reverse("model-deploy", args=[model.pk]) + f"?node={node.pk}" + query
    return client.post(url, {**data, "node_id": node.pk}) if data else client.get(url)


def test_deploy_is_off_where_the_model_does_not_fit_and_says_why(operator_client):
    model, node = _cpu(30)
    html = _page(operator_client, model, node).content.decode()
    assert 'id="deploy-submit" disabled' in html
    assert "Deploy is off: does not fit: needs ~34.0 GiB of RAM" in html and "--override-fit" in html
    assert 'name="override_fit"' not in html  # an operator cannot override


def test_an_admin_gets_deploy_anyway_and_a_model_that_fits_gets_deploy_on(client):
    model, node = _cpu(30)
    client.force_login(UserFactory(role="admin"))
    html = _page(client, model, node).content.decode()
    assert 'name="override_fit"' in html and "Deploy anyway, against the fit check" in html
    small = ModelRepoFactory(files=[{"path": "m.safetensors", "size": GiB}], total_size=GiB)
    ModelCopyFactory(model=small, node=node, path="/models/small")
    html = _page(client, small, node).content.decode()
    assert 'id="deploy-submit">' in html and "Deploy is off" not in html


def test_check_fit_weighs_the_values_sent_and_deploys_nothing(operator_client, sent_tasks):
    model, node = _cpu(2)
    first = _page(operator_client, model, node).content.decode()
    assert "fits in RAM" in first and "Deploy is off" not in first
    data = {"port": 8001, "tp": 1, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
            "stall_seconds": 600, "env": "VLLM_CPU_KVCACHE_SPACE=40", "check": "1"}
    response = _page(operator_client, model, node, **data)
    assert response.status_code == 200 and not Deployment.objects.exists() and not sent_tasks.commit()
    html = response.content.decode()
    assert "KV cache 40.0 GiB" in html and 'id="deploy-submit" disabled' in html


def test_a_cpu_node_shows_no_gpu_or_multi_node_field_and_sends_their_defaults(operator_client):
    model, node = _cpu(1)
    html = _page(operator_client, model, node).content.decode()
    for name in ("gpus", "tp", "pp", "dp", "expert_parallel", "gpu_memory_utilization", "attention_backend",
                 "workers", "worker_gpus", "master_port"):
        assert f'data-field="{name}"' not in html, name
    assert '<input type="hidden" name="tp" value="1"' in html and 'name="gpu_memory_utilization" value="0.9"' in html
    assert 'data-field="max_num_seqs"' in html and "Stop other vLLM engines on this node" in html


def test_a_gpu_node_with_another_node_shows_the_gpu_and_multi_node_fields(operator_client):
    node = NodeFactory(name="gpu-01")
    GpuFactory(node=node, index=0)
    NodeFactory(name="gpu-02")
    model = ModelCopyFactory(node=node, path="/models/m").model
    html = _page(operator_client, model, node).content.decode()
    for name in ("gpus", "tp", "gpu_memory_utilization", "workers", "master_port"):
        assert f'data-field="{name}"' in html, name


FORM = {"port": 8001, "tp": 1, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
        "stall_seconds": 600, "env": "VLLM_CPU_KVCACHE_SPACE=1"}


def test_a_deploy_sent_anyway_is_refused_naming_the_fit_and_an_admins_override_is_on_the_timeline(client, sent_tasks):
    model, node = _cpu(30)
    client.force_login(UserFactory(role="operator"))
    response = _page(client, model, node, **FORM, override_fit="on")  # Deploy pressed with the button forced on
    assert response.status_code == 409 and not Deployment.objects.exists()
    assert "Only an admin can deploy against the fit check" in response.content.decode()
    response = _page(client, model, node, **FORM)
    assert response.status_code == 409 and "acme/big does not fit cpu-01: needs ~34.0 GiB of RAM" in response.content.decode()
    client.force_login(UserFactory(role="admin"))
    response = _page(client, model, node, **FORM, override_fit="on")
    d = Deployment.objects.get()
    assert response.status_code == 302 and response["Location"] == reverse("deployment-detail", args=[d.pk])
    assert d.events.get(step="fit_override").message.startswith("Deployed although the fit check says does not fit")



def _html(response) -> str:
    assert response.status_code == 200, response.status_code
    return response.content.decode()


def _context_rows(html: str) -> dict:
    """The context table as shown: {(kv dtype, dcp): {"longest", "tokens", "sequences", "note", "chosen"}}."""
    table = html[html.index('id="context-fit"'):]
    table = table[:table.index("</table>")]
    rows = {}
    for kv, dcp, attrs, body in re.findall(r'<tr data-kv="([^"]+)" data-dcp="(\d+)"([^>]*)>(.*?)</tr>', table, re.S):
        cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", body, re.S)]
        rows[kv, int(dcp)] = {"longest": cells[2], "tokens": cells[3], "sequences": cells[4], "note": cells[7],
                              "chosen": "chosen" in attrs}
    return rows


def _number(text: str) -> float:
    return float(text.replace(" million", "e6").replace(",", ""))


def test_the_deploy_page_says_how_much_context_kimi_holds_on_eight_gpus(operator_client):
    node = NodeFactory(name="gpu-01", engine_version="0.32.0", engine_flags=KIMI_FLAGS)
    for i in range(8):  # 8 × 96 GB, as the published figures are for
        GpuFactory(node=node, index=i, name="RTX PRO 6000", compute_capability="12.0", memory_total=96 * 10**9)
    model = ModelRepoFactory(repo_id="moonshotai/Kimi-K2.5", config=kimi_config("kimi-k2.5-int4"), attention="mla",
                             files=[{"path": "model.safetensors", "size": 547 * 10**9}], total_size=547 * 10**9)
    ModelCopyFactory(model=model, node=node, path="/models/kimi")
    html = _html(_page(operator_client, model, node, query=f"&recipe={kimi_recipe_id()}&strategy=single_node_tp"))
    assert 'id="context-fit"' in html and "TP 8 × DCP 8; sequences at 262,144 tokens" in html
    rows = _context_rows(html)
    assert set(rows) == {(kv, dcp) for kv in ("auto", "fp8") for dcp in (1, 2, 4, 8)}  # the recipe's KV dtypes
    for dcp, published in ((1, 450_000), (8, 3_600_000)):  # FP8 at the recipe's 0.93: the published figures
        assert abs(_number(rows["fp8", dcp]["tokens"]) - published) <= 0.05 * published, rows["fp8", dcp]
    assert rows["fp8", 8]["chosen"] and not rows["fp8", 1]["chosen"]  # the SM120 overlay's DCP 8
    assert rows["fp8", 8]["note"] == "these settings"
    assert _number(rows["auto", 1]["longest"]) < 262_144 == _number(rows["fp8", 1]["longest"])  # BF16: less than the model's limit
    assert int(rows["fp8", 8]["sequences"]) > int(rows["fp8", 1]["sequences"]) >= 1
    # The preset's TP 1 on the same node: the table says there is no room, and why.
    one = _context_rows(_html(_page(operator_client, model, node)))
    assert one["auto", 1]["tokens"] == "0" and "no room for a KV cache" in one["auto", 1]["note"]


def test_a_layout_over_gpus_whose_p2p_is_off_is_warned_after_check_fit_and_the_node_choice_follows(
        operator_client, tmp_path):
    node = NodeFactory(name="gpu-02")
    fine = NodeFactory(name="gpu-03")
    for n in (node, fine):
        for i in range(2):
            GpuFactory(node=n, index=i)
    run_on(node, tmp_path, doctor_facts(p2p_off=True))
    run_on(fine, tmp_path, doctor_facts())
    model = ModelRepoFactory(files=[{"path": "m.safetensors", "size": GiB}], total_size=GiB)
    for n in (node, fine):
        ModelCopyFactory(model=model, node=n, path="/models/m")
    assert 'id="host-warnings"' not in _html(_page(operator_client, model, node))  # the preset's one GPU: no P2P
    tp2 = {**FORM, "tp": 2, "gpus": ["0", "1"], "env": "", "check": "1"}
    html = _html(_page(operator_client, model, node, **tp2))  # "Check fit" with two GPUs chosen
    warning = html[html.index('id="host-warnings"'):html.index("</div>", html.index('id="host-warnings"'))]
    assert "This layout (2 GPUs) depends on a failing host check — its all-reduce uses P2P between the GPUs" in warning
    assert "NCCL_P2P_DISABLE=1" in warning and f"/nodes/{node.pk}/#host-doctor" in warning
    assert 'id="deploy-nccl-presets"' in html and "PCIe, high concurrency" in html
    assert "PCIe, low concurrency" not in html  # P2P off: only the P2P-free preset
    html = _html(_page(operator_client, model, node, **{**tp2, "env": "NCCL_P2P_DISABLE=1"}))
    assert 'id="host-warnings"' not in html
    html = _html(_page(operator_client, model, fine, **tp2))  # another node picked: its own checks, both presets
    assert 'id="host-warnings"' not in html and "PCIe, low concurrency" in html
