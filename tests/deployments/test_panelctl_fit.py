"""panelctl against the real ASGI server: a deploy the fit check says will not fit
exits 3 naming the fit, an operator's --override-fit exits 4, an admin's deploys and the timeline says so;
model-remove forgets a model added by mistake and refuses one that has a copy, saying so."""
import pytest

from deployments.models import Deployment, ModelRepo
from panelctl import cli
from plumbing import tokens
from tests.deployments.test_panelctl_refusals import login  # noqa: F401 (a fixture)
from tests.factories import ModelCopyFactory, ModelRepoFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
GiB = 2**30


@pytest.fixture
def too_big():
    node = NodeFactory(name="cpu-01", ram_total=24 * GiB, cpu_count=2,
                       engine_flags=["--enforce-eager", "--served-model-name", "--gpu-memory-utilization"])
    model = ModelRepoFactory(repo_id="acme/huge-chat", files=[{"path": "model.safetensors", "size": 40 * GiB}],
                             total_size=40 * GiB)
    return node, model


def test_a_deploy_that_does_not_fit_exits_3_naming_the_fit_and_leaves_nothing(login, too_big, capsys):  # noqa: F811
    assert cli.main([*login, "deploy", "acme/huge-chat", "--node", "cpu-01"]) == 3
    err = capsys.readouterr().err
    assert "409 acme/huge-chat does not fit cpu-01: needs ~44.0 GiB of RAM" in err and "--override-fit" in err
    assert not Deployment.objects.exists()


def test_only_an_admin_overrides_the_fit_check_and_the_timeline_says_so(login, too_big, live_server_asgi, capsys):  # noqa: F811
    assert cli.main([*login, "deploy", "acme/huge-chat", "--node", "cpu-01", "--override-fit"]) == 4
    assert "Only an admin can deploy against the fit check" in capsys.readouterr().err
    admin = ["--url", live_server_asgi, "--token", tokens.issue(UserFactory(role="admin"))]
    ModelCopyFactory(model=too_big[1], node=too_big[0], path="/models/huge")
    assert cli.main([*admin, "deploy", "acme/huge-chat", "--node", "cpu-01", "--override-fit"]) == 0
    event = Deployment.objects.get().events.get(step="fit_override")
    assert event.level == "warning" and event.message.startswith("Deployed although the fit check says does not fit")


def test_model_remove_forgets_a_model_added_by_mistake_and_refuses_one_with_a_copy(login, capsys):  # noqa: F811
    ModelRepoFactory(repo_id="acme/typo")
    assert cli.main([*login, "model-remove", "acme/typo"]) == 0
    assert "Removed acme/typo." in capsys.readouterr().err and not ModelRepo.objects.filter(repo_id="acme/typo").exists()
    ModelCopyFactory(model__repo_id="acme/kept", node=NodeFactory(name="cpu-02"))
    assert cli.main([*login, "model-remove", "acme/kept"]) == 3
    assert "acme/kept has copies on cpu-02: delete them first." in capsys.readouterr().err
    assert cli.main([*login, "model-remove", "acme/never-added"]) == 5
