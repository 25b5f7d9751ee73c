"""Defaults that work on the node they run on: a free engine port, the node's preset applied by
the server for the API, the CLI and the form alike, and a deploy that is tried again reusing its row."""

import pytest
from django.urls import reverse

from deployments.models import Deployment
from deployments.services import deploys
from panelctl import cli, client
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def cpu_node(sent_tasks):
    node = NodeFactory(name="cpu-01")
    copy = ModelCopyFactory(node=node, path="/models/m")
    return node, copy.model


def test_free_port_is_never_the_panels_and_skips_active_deployments(settings, cpu_node):
    node, model = cpu_node
    settings.PANEL_PORT, settings.ENGINE_PORT_FIRST = 8100, 8100
    DeploymentFactory(node=node, port=8101, status=Deployment.Status.READY)
    DeploymentFactory(node=node, port=8102, status=Deployment.Status.STOPPED)  # a stopped one frees its port
    assert deploys.deployment_free_port(node) == 8102


def test_api_deploy_with_no_field_on_a_cpu_node_gets_the_cpu_preset_and_a_free_port(settings, api, cpu_node):
    node, model = cpu_node
    response = api.post("/api/deployments/", {"model": model.pk, "node": node.name}, format="json")
    assert response.status_code == 202, response.json()
    d = Deployment.objects.get()
    assert d.engine_args["enforce-eager"] is True and d.env["VLLM_CPU_KVCACHE_SPACE"]
    assert d.port != settings.PANEL_PORT and d.port >= settings.ENGINE_PORT_FIRST


def test_api_deploy_keeps_the_callers_flags_over_the_preset(api, cpu_node):
    node, model = cpu_node
    response = api.post("/api/deployments/", {"model": model.pk, "node": node.name,
                                              "engine_args": {"max-model-len": 512}}, format="json")
    assert response.status_code == 202, response.json()
    assert Deployment.objects.get().engine_args["max-model-len"] == 512


def test_api_deploy_on_a_gpu_node_gets_the_one_gpu_preset_not_the_cpu_one(api, sent_tasks):
    node = NodeFactory(name="gpu-02")
    GpuFactory(node=node, index=0)
    model = ModelCopyFactory(node=node, path="/models/m").model
    response = api.post("/api/deployments/", {"model": model.pk, "node": node.name, "gpus": [0]}, format="json")
    assert response.status_code == 202, response.json()
    d = Deployment.objects.get()
    assert "enforce-eager" not in d.engine_args and "VLLM_CPU_KVCACHE_SPACE" not in d.env


def test_a_failed_deploy_tried_again_reuses_its_row(api, cpu_node):
    node, model = cpu_node
    first = api.post("/api/deployments/", {"model": model.pk, "node": node.name}, format="json").json()
    Deployment.objects.filter(pk=first["id"]).update(status=Deployment.Status.FAILED)
    again = api.post("/api/deployments/", {"model": model.pk, "node": node.name}, format="json")
    assert again.status_code == 202, again.json()
    assert again.json()["id"] == first["id"] and Deployment.objects.count() == 1
    assert Deployment.objects.get().status == Deployment.Status.QUEUED


def test_an_existing_name_is_redeployed_only_when_asked(api, cpu_node):
    node, model = cpu_node
    body = {"model": model.pk, "node": node.name, "name": "mine"}
    first = api.post("/api/deployments/", body, format="json").json()
    Deployment.objects.filter(pk=first["id"]).update(status=Deployment.Status.READY)
    refused = api.post("/api/deployments/", body, format="json")
    assert refused.status_code == 409 and "--replace" in refused.json()["error"]["message"]
    replaced = api.post("/api/deployments/", {**body, "replace_existing": True, "engine_args": {"max-num-seqs": 8}},
                        format="json")
    assert replaced.status_code == 202, replaced.json()
    d = Deployment.objects.get()
    assert replaced.json()["id"] == d.pk and d.engine_args["max-num-seqs"] == 8 and d.status == Deployment.Status.QUEUED


def test_deploy_form_on_a_cpu_node_names_the_cpu_preset_and_a_free_port(settings, client, operator, cpu_node):
    node, model = cpu_node
    client.force_login(operator)
    page = client.get(reverse("model-deploy", args=[model.pk]) + f"?node={node.pk}").content.decode()
    assert '<option value="cpu-test" selected>' in page
    assert f'name="port" value="{settings.ENGINE_PORT_FIRST}"' in page and "One GPU</option>" in page


def test_model_page_says_a_cpu_node_runs_it_and_shows_the_disk_check_before_download(client, operator):
    node = NodeFactory(name="cpu-02", disk_free=2**30, disk_total=4 * 2**30, ram_total=16 * 2**30, cpu_count=2)
    model = ModelRepoFactory(total_size=3 * 2**30, config={"architectures": ["LlamaForCausalLM"]}, files=[])
    client.force_login(operator)
    page = client.get(reverse("model-detail", args=[model.pk])).content.decode()
    assert "No node with GPUs" not in page and "does not fit" not in page
    fits = page[page.index('id="fits"'):page.index("</table>", page.index('id="fits"'))]
    assert "2 cores, 16.0 GiB RAM" in fits and "fits in RAM" in fits and "needs 1 GPUs" not in fits
    disk = page[page.index('id="disk-check"'):]
    assert f'data-node="{node.name}"' in disk and "3.0 GiB" in disk and "not enough room" in disk
    assert '<option value="1" selected>1</option>' in page  # TP follows the nodes' GPU count, not 8


def test_the_fit_check_weighs_a_cpu_node_by_its_ram(client, operator, api):
    small = NodeFactory(name="cpu-small", ram_total=4 * 2**30, cpu_count=2)
    unknown = NodeFactory(name="cpu-new")
    model = ModelRepoFactory(total_size=3 * 2**30, config={"architectures": ["LlamaForCausalLM"]}, files=[])
    client.force_login(operator)
    page = client.get(reverse("model-detail", args=[model.pk])).content.decode()
    assert "does not fit: needs ~7.0 GiB of RAM" in page and "unknown until the node reports its RAM" in page
    answer = api.get(f"/api/models/{model.pk}/fit/", {"node": small.name, "tp": 1}).json()
    assert answer["kind"] == "cpu" and answer["fits"] is False and answer["ram_total"] == 4 * 2**30
    assert unknown.ram_total == 0


def test_pages_write_sizes_in_binary_units_with_the_unit(client, operator):
    node = NodeFactory(disk_free=5 * 2**30, disk_total=10 * 2**30)
    client.force_login(operator)
    page = client.get(reverse("node-detail", args=[node.pk])).content.decode()
    assert "5.0 GiB" in page and " GB" not in page and " MB" not in page


class ApiPanel(client.Panel):
    """panelctl's client answered by the API in-process (the real views and serializers)."""

    def __init__(self, client):
        self.client = client

    def call(self, method, path, params=None, json=None, headers=None):
        response = (self.client.get(f"/api/{path}", params or {}) if method == "GET"
                    else self.client.post(f"/api/{path}", json or {}, format="json"))
        if response.status_code >= 400:
            raise client.CliError(response.json()["error"]["message"], client.EXIT.get(response.status_code, 6))
        return response.json()


def test_panelctl_lists_deployments_and_shows_one(api, cpu_node, capsys):
    node, model = cpu_node
    DeploymentFactory(name="tiny-cpu", node=node, model=model, status=Deployment.Status.READY,
                      engine_args={"enforce-eager": True, "max-model-len": 2048})
    args = cli.parser().parse_args(["list", "deployments"])
    assert args.fn(ApiPanel(api), args) == 0
    assert "tiny-cpu" in capsys.readouterr().out
    args = cli.parser().parse_args(["status", "deployment", "tiny-cpu"])
    assert args.fn(ApiPanel(api), args) == 0
    shown = capsys.readouterr().out
    assert "tiny-cpu: ready" in shown and "--enforce-eager --max-model-len 2048" in shown and "none (CPU)" in shown


def test_panelctl_deploy_to_an_existing_name_says_to_replace_then_redeploys(api, cpu_node, capsys):
    node, model = cpu_node
    argv = ["deploy", str(model.pk), "--node", node.name, "--name", "mine"]
    args = cli.parser().parse_args(argv)
    assert args.fn(ApiPanel(api), args) == 0
    Deployment.objects.filter(name="mine").update(status=Deployment.Status.READY)
    with pytest.raises(client.CliError, match="--replace") as refused:
        args.fn(ApiPanel(api), args)
    assert refused.value.code == 3
    args = cli.parser().parse_args([*argv, "--replace"])
    assert args.fn(ApiPanel(api), args) == 0
    d = Deployment.objects.get()
    assert d.status == Deployment.Status.QUEUED and d.engine_args["enforce-eager"] is True  # the CPU preset, as the form


def test_panelctl_deploy_without_a_node_takes_the_one_holding_the_model_ready(api, cpu_node):
    node, model = cpu_node
    NodeFactory(name="empty-02")  # a second node, without the model
    args = cli.parser().parse_args(["deploy", str(model.pk)])
    assert args.fn(ApiPanel(api), args) == 0
    assert Deployment.objects.get().node == node
    elsewhere = ModelRepoFactory()
    args = cli.parser().parse_args(["deploy", str(elsewhere.pk)])
    with pytest.raises(client.CliError, match="Give --node") as refused:
        args.fn(ApiPanel(api), args)
    assert refused.value.code == 2


def test_every_node_page_has_host_charts_and_gpu_charts_only_where_there_are_gpus(client, operator):
    cpu = NodeFactory(name="cpu-charts", nvml_error="NVML Shared Library Not Found", cpu_count=2)
    gpu = NodeFactory(name="gpu-charts")
    GpuFactory(node=gpu, index=0)
    client.force_login(operator)
    cpu_page = client.get(reverse("node-detail", args=[cpu.pk])).content.decode()
    gpu_page = client.get(reverse("node-detail", args=[gpu.pk])).content.decode()
    for chart in ("chart-host-cpu", "chart-host-ram", "chart-host-disk", "chart-host-net"):
        assert f'id="{chart}"' in cpu_page and f'id="{chart}"' in gpu_page
    assert 'id="chart-mem"' not in cpu_page and 'id="chart-mem"' in gpu_page


def test_default_levels_on_a_cpu_node_follow_its_cores():
    from benchmarks import selectors

    node = NodeFactory(name="two-cores", cpu_count=2)
    d = DeploymentFactory(node=node, engine_args={"max-num-seqs": 64})
    assert selectors.default_levels(d) == [1, 2, 4, 8, 16, 32]  # 16 streams a core, under its max-num-seqs
