"""The model page says true things and offers only what applies: counts formatted, file sizes
that are not "0.0 MiB", "verified" once a copy is ready, no Download where the model already is, a model
the hub could not read can be removed, and the add form's address answers a GET with the form."""
import pytest
from django.urls import reverse
from django.utils import timezone

from deployments.models import DeploymentRank, ModelRepo
from deployments.services import repos
from plumbing.errors import ServiceError
from tests.factories import DeploymentFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = pytest.mark.django_db
FILES = [{"path": "model.safetensors", "size": 3_800_000, "sha256": "a" * 64, "blob_id": None},
         {"path": "tokenizer_config.json", "size": 2048, "sha256": None, "blob_id": "b" * 40}]


def _model(**kwargs):
    return ModelRepoFactory(repo_id="acme/tiny-chat", files=FILES, inspected=timezone.now(), commit="c" * 40, **kwargs)


def _html(client, model):
    return client.get(reverse("model-detail", args=[model.pk])).content.decode()


def test_a_get_of_the_add_address_lands_on_the_add_form(operator_client):
    for name in ("model-add", "model-add-local"):
        response = operator_client.get(reverse(name))
        assert response.status_code == 302 and response["Location"] == "/models/#add-model"


def test_parameters_under_a_million_are_written_with_separators(operator_client):
    assert '<dd id="parameters">950,912</dd>' in _html(operator_client, _model(num_parameters=950912))
    assert '<dd id="parameters">8.0 billion</dd>' in _html(operator_client, ModelRepoFactory(num_parameters=8_030_261_248))


def test_the_commit_id_is_clipped_in_its_card_with_the_whole_id_in_its_title(operator_client):
    assert f'<code class="clip" id="commit" title="{"c" * 40}">' in _html(operator_client, _model())


def test_a_ready_copy_lists_its_files_verified_and_in_units_that_show_them(operator_client):
    model = _model()
    ModelCopyFactory(model=model, node=NodeFactory(name="cpu-01"), state="ready")
    html = _html(operator_client, model)
    assert "<td>model.safetensors</td><td class=\"num\">3.6 MiB · verified</td>" in html
    assert "<td>tokenizer_config.json</td><td class=\"num\">2,048 B · verified</td>" in html


def test_a_download_in_progress_lists_what_each_file_has(operator_client):
    model = _model()
    ModelCopyFactory(model=model, node=NodeFactory(), state="downloading",
                     progress={"files": {"model.safetensors": [1_900_000, 3_800_000]}})
    assert '<td class="num">1.8 MiB / 3.6 MiB</td>' in _html(operator_client, model)


def test_download_is_offered_only_to_nodes_without_the_model(operator_client):
    model = _model()
    ready_on, other = NodeFactory(name="cpu-01"), NodeFactory(name="cpu-02")
    ModelCopyFactory(model=model, node=ready_on, state="ready")
    html = _html(operator_client, model)
    form = html[html.index('id="download-form"'):html.index("</form>", html.index('id="download-form"'))]
    assert ">cpu-02</option>" in form and ">cpu-01</option>" not in form
    ModelCopyFactory(model=model, node=other, state="failed")  # a failed copy can be downloaded again
    assert 'id="download-form"' in _html(operator_client, model)
    other.model_copies.update(state="ready")
    html = _html(operator_client, model)
    assert 'id="download-form"' not in html and "On every node already" in html


def test_a_model_the_hub_could_not_read_offers_remove_not_deploy_and_is_removed(operator_client):
    model = ModelRepoFactory(repo_id="acme/gone", inspect_error="Repository not found", files=[])
    html = _html(operator_client, model)
    assert 'id="remove-model"' in html and 'id="deploy-button"' not in html and 'id="download-form"' not in html
    response = operator_client.post(reverse("model-remove", args=[model.pk]))
    assert response.status_code == 302 and not ModelRepo.objects.filter(pk=model.pk).exists()


def test_a_model_with_a_copy_or_a_deployment_is_not_removed_and_says_what_holds_it(api):
    model = _model()
    copy = ModelCopyFactory(model=model, node=NodeFactory(name="cpu-01"))
    response = api.delete(f"/api/models/{model.pk}/")
    assert response.status_code == 409 and response.json()["error"]["message"] == (
        "acme/tiny-chat has copies on cpu-01: delete them first.")
    copy.delete()
    DeploymentFactory(model=model, name="tiny-cpu-01", status="stopped")
    assert "has deployments (tiny-cpu-01)" in api.delete(f"/api/models/{model.pk}/").json()["error"]["message"]
    lone = ModelRepoFactory(repo_id="acme/typo")
    assert api.delete(f"/api/models/{lone.pk}/").status_code == 204 and not ModelRepo.objects.filter(pk=lone.pk).exists()


def test_a_copy_a_worker_rank_serves_from_is_not_deleted_and_is_shown_in_use():
    """A multi-node deployment headed elsewhere holds the copy on its worker node through its rank there."""
    head, worker = NodeFactory(name="gpu-a"), NodeFactory(name="gpu-b")
    model = _model()
    ModelCopyFactory(model=model, node=head, path="/models/a")
    copy = ModelCopyFactory(model=model, node=worker, path="/models/b")
    d = DeploymentFactory(model=model, node=head, name="two-nodes", status="ready")
    DeploymentRank.objects.create(deployment=d, node=worker, rank=1, state=DeploymentRank.State.RUNNING)
    with pytest.raises(ServiceError) as refused:
        repos.model_copy_delete(copy)
    assert refused.value.code == "in_use" and "by two-nodes" in refused.value.message
    other = ModelCopyFactory(node=worker, path="/models/other")
    assert {r["model"]: r["in_use"] for r in repos._deletable(worker, exclude=other)} == {str(model): True}
    DeploymentRank.objects.filter(deployment=d).update(state=DeploymentRank.State.STOPPED)
    assert repos.model_copy_delete(copy).state == "deleting"
