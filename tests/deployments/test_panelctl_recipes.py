"""`panelctl recipes import PATH` against the real ASGI server: a checkout in vllm-project/recipes' layout is stored
under its folder's name at its git commit and listed; one file imports under --source; a malformed file refuses
the whole import (exit 2) naming file and field; an operator is refused (exit 4) and a missing path is said."""
import shutil
from pathlib import Path

import pytest

from deployments.models import Recipe
from panelctl import cli
from plumbing import tokens
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
GOOD = Path(__file__).resolve().parent.parent / "fixtures" / "recipes"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _as(live_server_asgi, role):
    return ["--url", live_server_asgi, "--token", tokens.issue(UserFactory(role=role))]


@pytest.fixture
def checkout(tmp_path):
    """A checkout of the recipes repository at COMMIT: the good fixtures and a .git naming the commit."""
    folder = tmp_path / "recipes"
    shutil.copytree(GOOD / "good", folder)
    (folder / ".git" / "refs" / "heads").mkdir(parents=True)
    (folder / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (folder / ".git" / "refs" / "heads" / "main").write_text(COMMIT + "\n")
    return folder


def test_a_checkout_is_imported_under_its_folders_name_at_its_commit_and_listed(live_server_asgi, checkout, capsys):
    admin = _as(live_server_asgi, "admin")
    assert cli.main([*admin, "recipes", "import", str(checkout)]) == 0
    assert capsys.readouterr().out.strip() == "Imported 1 recipe(s) and 4 strategy file(s) as import:recipes at 0123456789ab."
    row = Recipe.objects.get(name="acme/Moe-1T", source="import:recipes")
    assert (row.kind, row.version, row.path) == ("model", COMMIT, "models/acme/Moe-1T.yaml")
    assert set(Recipe.objects.filter(source="import:recipes", kind="strategy").values_list("name", flat=True)) == {
        "multi_node_tp", "pd_cluster", "single_node_dep", "single_node_tp"}
    assert cli.main([*admin, "recipes", "list", "--name", "acme/Moe-1T"]) == 0
    listed = capsys.readouterr().out
    assert "acme/Moe-1T" in listed and "import:recipes" in listed and COMMIT[:12] in listed


def test_one_file_imports_under_the_source_given_and_replaces_only_that_source(live_server_asgi, checkout, capsys):
    admin = _as(live_server_asgi, "admin")
    assert cli.main([*admin, "recipes", "import", str(checkout)]) == 0
    one = checkout / "models" / "acme" / "Moe-1T.yaml"
    assert cli.main([*admin, "recipes", "import", str(one), "--source", "my-fixes", "--version", "v2"]) == 0
    assert "Imported 1 recipe(s) and 0 strategy file(s) as import:my-fixes at v2." in capsys.readouterr().out
    mine = Recipe.objects.get(source="import:my-fixes")
    assert (mine.name, mine.version, mine.path) == ("acme/Moe-1T", "v2", "models/acme/Moe-1T.yaml")
    assert Recipe.objects.filter(source="import:recipes").count() == 5  # the checkout's import is left as it was


def test_a_malformed_file_refuses_the_whole_import_naming_file_and_field(live_server_asgi, checkout, capsys):
    admin = _as(live_server_asgi, "admin")
    shutil.copy(GOOD / "bad" / "no_default.yaml", checkout / "models" / "acme" / "Bad.yaml")
    assert cli.main([*admin, "recipes", "import", str(checkout)]) == 2
    err = capsys.readouterr().err
    assert "Nothing imported: models/acme/Bad.yaml: variants: a `default` variant is required" in err
    assert not Recipe.objects.filter(source__startswith="import:").exists()


def test_an_operator_is_refused_and_a_missing_path_is_said(live_server_asgi, checkout, capsys):
    assert cli.main([*_as(live_server_asgi, "operator"), "recipes", "import", str(checkout)]) == 4
    assert not Recipe.objects.filter(source__startswith="import:").exists()
    capsys.readouterr()
    admin = _as(live_server_asgi, "admin")
    assert cli.main([*admin, "recipes", "import", str(checkout / "nowhere")]) == 2
    assert f"{checkout / 'nowhere'}: no such file or folder." in capsys.readouterr().err
    empty = checkout.parent / "empty"
    empty.mkdir()
    assert cli.main([*admin, "recipes", "import", str(empty)]) == 2
    assert "no models/<org>/<model>.yaml or strategies/<name>.yaml in it" in capsys.readouterr().err
