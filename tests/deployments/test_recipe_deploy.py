"""Recipes in the panel: loaded from the recipes folder and imported from a checkout with their source and version
(a malformed file named by file and field), shown on the model page with each flag's reason, filling the deploy
form; the compatibility gate refusing what would fail with the reason and the fix unless an admin overrides it
(on the timeline); and the form, the API and `panelctl deploy --recipe` giving one argv for one choice."""
import json
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
from django.urls import reverse
from rest_framework.test import APIClient

from deployments.host import serveargv
from deployments.models import Deployment, Recipe
from deployments.services import deploys, recipes
from panelctl import cli
from plumbing import tokens
from plumbing.errors import ServiceError
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory, UserFactory

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
KIMI_FLAGS = ["--tensor-parallel-size", "--gpu-memory-utilization", "--trust-remote-code", "--tool-call-parser",
              "--enable-auto-tool-choice", "--reasoning-parser", "--attention-backend", "--kv-cache-dtype",
              "--decode-context-parallel-size", "--enable-chunked-prefill", "--enable-prefix-caching", "--async-scheduling",
              "--max-num-batched-tokens", "--load-format", "--served-model-name", "--max-model-len"]


def _node(name="gpu-01", gpu="RTX PRO 6000", capability="12.0", memory=96 * 2**30, count=8, version="0.32.0"):
    node = NodeFactory(name=name, engine_version=version, engine_flags=KIMI_FLAGS)
    for i in range(count):
        GpuFactory(node=node, index=i, name=gpu, compute_capability=capability, memory_total=memory)
    return node


def _model(node, repo_id="moonshotai/Kimi-K2.5", config=None):
    model = ModelRepoFactory(repo_id=repo_id, config=config or {}, attention="mla" if "Kimi" in repo_id else "",
                             files=[{"path": "model.safetensors", "size": 10**9}], total_size=10**9)
    ModelCopyFactory(model=model, node=node, path=f"/models/{repo_id}")
    return model


def _config(name):
    return json.loads((FIXTURES / "configs" / f"{name}.json").read_text())


def _kimi_id():
    recipes.recipes_sync(force=True)
    return Recipe.objects.get(kind="model", name="moonshotai/Kimi-K2.5", source="panel").pk


# --- loading and importing ------------------------------------------------------------------------------------

@pytest.mark.django_db
def test_the_shipped_recipes_load_with_their_source_and_version():
    assert recipes.recipes_sync(force=True) == []
    rows = {(r.kind, r.name): r for r in Recipe.objects.all()}
    assert {("model", "moonshotai/Kimi-K2.5"), ("model", "MiniMaxAI/MiniMax-M2.5"), ("model", "zai-org/GLM-5"),
            ("model", "local/tiny-model"), ("strategy", "single_node_tep")} <= set(rows)
    kimi = rows["model", "moonshotai/Kimi-K2.5"]
    assert kimi.source == "panel" and kimi.version and kimi.path == "models/moonshotai/Kimi-K2.5.yaml"
    assert kimi.data["variants"]["default"]["vram_minimum_gb"] == 714


@pytest.mark.django_db
def test_a_recipes_dir_with_a_malformed_file_loads_the_others_and_names_the_file_and_field(tmp_path, settings):
    shutil.copytree(FIXTURES / "recipes" / "good", tmp_path, dirs_exist_ok=True)
    (tmp_path / "models" / "acme" / "Bad.yaml").write_text((FIXTURES / "recipes" / "bad" / "vram_text.yaml").read_text())
    settings.RECIPES_DIR = str(tmp_path)
    errors = recipes.recipes_sync(force=True)
    assert errors == ["models/acme/Bad.yaml: variants.default.vram_minimum_gb: expected a number, got 'lots'"]
    assert Recipe.objects.filter(source=f"folder:{tmp_path}", name="acme/Moe-1T").exists()
    assert not Recipe.objects.filter(name="acme/Bad").exists()
    (tmp_path / "models" / "acme" / "Bad.yaml").unlink()  # fixed: read again because the folder changed
    assert recipes.recipes_sync() == []


@pytest.mark.django_db
def test_an_import_is_all_or_nothing_admins_only_and_replaces_its_own_source():
    files = [(p.relative_to(FIXTURES / "recipes" / "good").as_posix(), p.read_text())
             for p in sorted((FIXTURES / "recipes" / "good").glob("**/*.yaml"))]
    api = APIClient()
    api.force_authenticate(UserFactory(role="operator"))
    body = {"source": "vllm-project/recipes", "version": "abc123", "files": [{"path": p, "text": t} for p, t in files]}
    assert api.post("/api/recipes/import/", body, format="json").status_code == 403
    api.force_authenticate(UserFactory(role="admin"))
    bad = {**body, "files": body["files"] + [{"path": "models/acme/Bad.yaml",
                                              "text": (FIXTURES / "recipes" / "bad" / "no_default.yaml").read_text()}]}
    refused = api.post("/api/recipes/import/", bad, format="json")
    assert refused.status_code == 400 and not Recipe.objects.filter(source__startswith="import:").exists()
    assert "models/acme/Bad.yaml: variants: a `default` variant is required" in refused.json()["error"]["message"]
    done = api.post("/api/recipes/import/", body, format="json")
    assert done.status_code == 201 and done.json() == {"models": 1, "strategies": 4, "source": "import:vllm-project/recipes"}
    row = Recipe.objects.get(name="acme/Moe-1T")
    assert (row.source, row.version) == ("import:vllm-project/recipes", "abc123")
    again = api.post("/api/recipes/import/", {**body, "version": "def456", "files": body["files"][:1]}, format="json")
    assert again.status_code == 201 and Recipe.objects.filter(source="import:vllm-project/recipes").count() == 1


# --- the gate -------------------------------------------------------------------------------------------------

def _create(model, node, user, **kwargs):
    return deploys.deployment_create(model=model, node=node, gpu_indices=kwargs.pop("gpus", list(range(8))), port=None,
                                     engine_args=kwargs.pop("engine_args", {}), env={}, user=user, **kwargs)


@pytest.mark.django_db
def test_kimi_on_eight_h100s_is_refused_for_its_memory_before_anything_starts(sent_tasks):
    node = _node(gpu="H100", capability="9.0", memory=80 * 10**9)
    model, admin = _model(node), UserFactory(role="admin")
    choice = recipes.Choice(_kimi_id(), "default", "single_node_tp")
    with pytest.raises(ServiceError) as refused:
        _create(model, node, admin, recipe=choice)
    assert refused.value.code == "incompatible" and not Deployment.objects.exists()
    assert "needs 714 GB of GPU memory; the 8 chosen GPU(s) have 640 GB" in refused.value.message
    assert "Fix: choose more or larger GPUs" in refused.value.message and "--override-compat" in refused.value.message


@pytest.mark.django_db
def test_a_recipe_deploy_over_a_stopped_row_of_the_default_name_still_runs_the_recipes_checks(sent_tasks):
    node = _node(gpu="H100", capability="9.0", memory=80 * 10**9)
    model, admin = _model(node), UserFactory(role="admin")
    kept = DeploymentFactory(name=deploys.deployment_default_name(model, node), model=model, node=node,
                             status=Deployment.Status.STOPPED, engine_args={"tensor-parallel-size": 8})
    kept.gpus.set(node.gpus.all())
    with pytest.raises(ServiceError) as refused:  # the row is deployed again, with the recipe's gate as a new one
        _create(model, node, admin, recipe=recipes.Choice(_kimi_id(), "default", "single_node_tp"))
    assert refused.value.code == "incompatible"
    assert "needs 714 GB of GPU memory; the 8 chosen GPU(s) have 640 GB" in refused.value.message
    kept.refresh_from_db()
    assert kept.status == Deployment.Status.STOPPED and not kept.events.exists()


@pytest.mark.django_db
def test_a_recipe_redeploy_of_the_default_name_names_the_recipe_and_what_changed(sent_tasks):
    node = _node()
    model = _model(node)
    kept = DeploymentFactory(name=deploys.deployment_default_name(model, node), model=model, node=node,
                             status=Deployment.Status.FAILED, engine_args={"tensor-parallel-size": 8})
    d = _create(model, node, UserFactory(role="admin"), recipe=recipes.Choice(_kimi_id(), "default", "single_node_tp"),
                engine_args={"max-model-len": 131072}, preset="auto")  # as the API sends it
    assert d.pk == kept.pk and d.status == Deployment.Status.QUEUED
    queued = d.events.get(step="queued")
    assert "Recipe moonshotai/Kimi-K2.5 · default · single_node_tp · sm120 (panel, " in queued.message
    assert "changed: --max-model-len 131072 (recipe: unset)" in queued.message
    assert queued.data["recipe"]["strategy"] == "single_node_tp" and queued.data["changed"] == {
        "--max-model-len": [None, 131072]}
    assert d.engine_args["attention-backend"] == "TRITON_MLA"


@pytest.mark.django_db
def test_only_an_admin_overrides_the_gate_and_the_timeline_records_it(sent_tasks):
    node = _node(version="0.18.0")
    model = _model(node)
    with pytest.raises(ServiceError) as refused:  # no recipe chosen: the model's own still names its minimum
        _create(model, node, UserFactory(role="admin"), engine_args={"tensor-parallel-size": 8})
    assert "needs vLLM 0.19.1 or later" in refused.value.message and "runs 0.18.0" in refused.value.message
    with pytest.raises(ServiceError) as forbidden:
        _create(model, node, UserFactory(role="operator"), engine_args={"tensor-parallel-size": 8}, override_compat=True)
    assert forbidden.value.code == "forbidden"
    d = _create(model, node, UserFactory(role="admin"), engine_args={"tensor-parallel-size": 8}, override_compat=True)
    event = d.events.get(step="compat_override")
    assert event.level == "warning" and "an admin overrode the compatibility check" in event.message
    assert event.data["codes"] == ["engine_too_old"]


@pytest.mark.django_db
def test_minimax_pure_tp8_is_refused_with_the_reason_and_tep_passes(sent_tasks):
    node = _node(gpu="H200", capability="9.0", memory=141 * 10**9)
    model = _model(node, "MiniMaxAI/MiniMax-M2.5", _config("minimax-m2.5"))
    admin = UserFactory(role="admin")
    with pytest.raises(ServiceError) as refused:
        _create(model, node, admin, engine_args={"tensor-parallel-size": 8})
    message = refused.value.message
    assert "intermediate_size / 8 = 192 is not divisible by the block of 128" in message  # the recipe's own
    assert "1536 / TP 8 = 192 is not divisible by the FP8 block of 128" in message  # the panel's table
    assert "TP 8 with expert parallel (single_node_tep)" in message
    d = _create(model, node, admin, engine_args={"tensor-parallel-size": 8, "enable-expert-parallel": True})
    assert not d.events.filter(step="compat_override").exists()


@pytest.mark.django_db
def test_an_attention_backend_the_gpus_lack_is_refused_on_the_deploy_page(client):
    node = _node()
    model = _model(node)
    client.force_login(UserFactory(role="admin"))
    url = reverse("model-deploy", args=[model.pk]) + f"?node={node.pk}"
    form = _form_values(client.get(url + f"&recipe={_kimi_id()}&strategy=single_node_tp").content.decode())
    form["attention_backend"] = "FLASHMLA"
    response = client.post(url, {**form, "node_id": node.pk})
    html = response.content.decode()
    assert response.status_code == 409 and not Deployment.objects.exists()
    assert "the FLASHMLA attention backend does not run on SM120 GPUs" in html and 'name="override_compat"' in html


# --- pages and one argv from every door ---------------------------------------------------------------------------

@pytest.mark.django_db
def test_the_model_page_lists_the_recipes_for_the_nodes_gpus_with_each_flags_reason(client):
    node = _node()
    model = _model(node)
    client.force_login(UserFactory(role="operator"))
    html = client.get(reverse("model-detail", args=[model.pk]) + f"?recipe_node={node.pk}").content.decode()
    assert "Kimi-K2.5 INT4</strong> · variant default · single_node_tp · sm120 overrides" in html
    assert "TRITON_MLA runs on SM120" in html and "at 0.95 an NCCL graph file runs out of memory" in html
    assert "the SM120 overlay&#x27;s decode context parallel 8 needs TP 8" in html  # single_node_dep is known to fail
    assert f"recipe={_kimi_id()}&amp;variant=default&amp;strategy=single_node_tep" in html


class _FormValues(HTMLParser):
    """What a browser submits from #deploy-form as rendered."""

    def __init__(self):
        super().__init__()
        self.values, self.inside, self.select, self.textarea = {}, False, None, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form":
            self.inside = a.get("id") == "deploy-form"
        if not self.inside:
            return
        if tag == "input" and a.get("name") and (a.get("type") not in ("checkbox", "radio") or "checked" in a):
            value = a.get("value", "on" if a.get("type") in ("checkbox", "radio") else "")
            self.values.setdefault(a["name"], []).append(value)
        elif tag == "select":
            self.select = a.get("name")
        elif tag == "option" and self.select and "selected" in a:
            self.values.setdefault(self.select, []).append(a.get("value", ""))
        elif tag == "textarea":
            self.textarea = a.get("name")
            self.values[self.textarea] = [""]

    def handle_endtag(self, tag):
        if tag == "form":
            self.inside = False
        if tag == "select":
            self.select = None
        if tag == "textarea":
            self.textarea = None

    def handle_data(self, data):
        if self.textarea:
            self.values[self.textarea][0] += data


def _form_values(html: str) -> dict:
    parser = _FormValues()
    parser.feed(html)
    parser.values.pop("csrfmiddlewaretoken", None)
    return {k: v if len(v) > 1 or k in ("gpus", "workers", "replace") else v[0] for k, v in parser.values.items()}


def _argv(d: Deployment) -> list[str]:
    return serveargv.build_argv("vllm", "/models/m", 8000, "127.0.0.1", d.engine_args)


@pytest.mark.django_db(transaction=True)
def test_the_form_the_api_and_panelctl_give_one_argv_for_one_recipe_choice(client, live_server_asgi, sent_tasks):
    node = _node()
    model = _model(node)
    admin = UserFactory(role="admin")
    kimi = _kimi_id()
    client.force_login(admin)
    url = reverse("model-deploy", args=[model.pk]) + f"?node={node.pk}"
    page = client.get(url + f"&recipe={kimi}&strategy=single_node_tp").content.decode()
    assert "Filled from the recipe moonshotai/Kimi-K2.5 · default · single_node_tp · sm120" in page
    form = {**_form_values(page), "name": "kimi-form", "node_id": node.pk}
    assert client.post(url, form).status_code == 302
    Deployment.objects.update(status=Deployment.Status.STOPPED)  # the GPUs free for the next door
    api = APIClient()
    api.force_authenticate(admin)
    made = api.post("/api/deployments/", {"model": model.pk, "node": node.name, "name": "kimi-api",
                                          "recipe": "moonshotai/Kimi-K2.5", "strategy": "single_node_tp"}, format="json")
    assert made.status_code == 202, made.json()
    Deployment.objects.update(status=Deployment.Status.STOPPED)
    login = ["--url", live_server_asgi, "--token", tokens.issue(admin)]
    assert cli.main([*login, "deploy", model.repo_id, "--node", node.name, "--name", "kimi-cli",
                     "--recipe", "moonshotai/Kimi-K2.5", "--strategy", "single_node_tp"]) == 0
    by = {d.name: d for d in Deployment.objects.all()}
    assert _argv(by["kimi-form"]) == _argv(by["kimi-api"]) == _argv(by["kimi-cli"])
    assert by["kimi-form"].env == by["kimi-api"].env == by["kimi-cli"].env
    assert by["kimi-form"].gpu_indices == by["kimi-api"].gpu_indices == by["kimi-cli"].gpu_indices == list(range(8))
    assert "--attention-backend TRITON_MLA" in " ".join(_argv(by["kimi-cli"]))
    queued = by["kimi-api"].events.get(step="queued")
    assert "Recipe moonshotai/Kimi-K2.5 · default · single_node_tp · sm120 (panel, " in queued.message
    assert queued.message.endswith(", unchanged.") and queued.data["recipe"]["strategy"] == "single_node_tp"


@pytest.mark.django_db
def test_the_first_step_says_which_recipe_and_what_the_user_changed(client, sent_tasks):
    node = _node()
    model = _model(node)
    client.force_login(UserFactory(role="admin"))
    url = reverse("model-deploy", args=[model.pk]) + f"?node={node.pk}"
    form = _form_values(client.get(url + f"&recipe={_kimi_id()}&strategy=single_node_tp").content.decode())
    form.update(max_model_len="131072", gpu_memory_utilization="0.9", node_id=node.pk)
    assert client.post(url, form).status_code == 302
    first = Deployment.objects.get().events.order_by("started", "id").first()
    assert first.step == "queued" and "Recipe moonshotai/Kimi-K2.5 · default · single_node_tp · sm120" in first.message
    assert "changed: --gpu-memory-utilization 0.9 (recipe: 0.93), --max-model-len 131072 (recipe: unset)" in first.message
    assert first.data["changed"] == {"--gpu-memory-utilization": [0.93, 0.9], "--max-model-len": [None, 131072]}
