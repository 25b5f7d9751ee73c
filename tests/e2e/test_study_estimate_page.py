"""Real Chromium, no engine: a study of a deployment nothing was measured of yet says its estimate is a guess,
in the form's count-and-estimate line and on the study's page, whose Pareto columns are named for what they
hold (rows made with tests/factories.py)."""
import pytest
from playwright.sync_api import expect

from tests.factories import DeploymentFactory, ModelCopyFactory, NodeFactory

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_a_first_studys_estimate_says_it_is_a_guess_in_the_form_and_on_its_page(logged_in_page):
    node = NodeFactory(engine_flags=["--max-num-seqs", "--served-model-name", "--port", "--host"])
    copy = ModelCopyFactory(node=node)
    d = DeploymentFactory(node=node, model=copy.model, status="ready", engine_args={"max-num-seqs": 8})
    page = logged_in_page
    page.goto(f"{page.base_url}/benchmarks/studies/")
    page.select_option("#id_deployment", str(d.pk))
    page.fill("#id_variants", "max-num-seqs=4")
    page.fill("#id_levels", "1")
    page.fill("#id_repeats", "2")
    page.click("#preview-button")
    expect(page.locator("#estimate-guess")).to_have_text("a guess")
    expect(page.locator("#preview")).to_contain_text("no load of it recorded yet")
    page.click("#start")
    expect(page.locator("#estimate")).to_contain_text("min (a guess: ")
    # The Pareto table's columns say what they hold: output tok/s (not "Total"), and tok/s per user.
    assert page.locator("#pareto thead th").all_text_contents()[2:5:2] == ["Output tok/s", "tok/s per user"]
