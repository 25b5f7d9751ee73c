"""Load time end to end (issue 16): a real node agent, the real CPU vLLM engine and Chromium.

A user deploys the tiny model with pre-warm on, watches its start-up as phases on a Gantt bar,
restarts it and sees the second load predicted from the first. (How close the prediction comes is a
figure, measured by perf/prewarm.py, not asserted here.)
"""
import time

import pytest
from playwright.sync_api import expect

from deployments.host import pagecache
from deployments.models import Deployment
from tests.conftest import free_port
from tests.e2e.test_deploy import LOAD_TIMEOUT_MS, _deploy_from_form

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def test_a_load_shows_its_phases_and_the_next_one_is_predicted(logged_in_page, cpu_node):
    node, model = cpu_node
    page = logged_in_page
    page.goto(f"{page.base_url}/models/{model.pk}/deploy/?node={node.pk}")
    page.check("#id_prewarm")
    _deploy_from_form(page, "tiny-lt", free_port())
    expect(page.locator("#status")).to_have_text("Ready", timeout=LOAD_TIMEOUT_MS)
    expect(page.locator("#timeline tbody td:first-child")).to_contain_text(["prewarm", "launch", "load"])
    expect(page.locator("#timeline")).to_contain_text("100 % of the model is in the page cache")
    d = Deployment.objects.get(name="tiny-lt")
    files = pagecache.weight_files(model.copies.get(node=node).path)
    assert pagecache.residency(files).percent == 100

    page.reload()  # the stored timeline, as a later visitor sees it
    for phase in ("process", "weights", "kv_cache", "api_up"):
        expect(page.locator(f'#load-gantt span[data-phase="{phase}"]')).to_have_count(1)
    expect(page.locator("#load-legend")).to_contain_text("weights")
    first = d.events.get(step="load").data["totals"]
    assert sum(first.values()) > 0

    page.click('button[data-action="restart"]')
    expect(page.locator("#load-forecast")).to_contain_text("from 1 earlier load", timeout=LOAD_TIMEOUT_MS)
    expect(page.locator("#status")).to_have_text("Ready", timeout=LOAD_TIMEOUT_MS)
    # Ready comes first; the load's phases are kept once the smoke test after it is done.
    deadline = time.monotonic() + 120
    while len(loads := list(d.events.filter(step="load", data__has_key="totals"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(loads) == 2
    assert Deployment.objects.get(pk=d.pk).load_detail["phases"]["segments"]
