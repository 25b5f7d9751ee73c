"""Real Chromium, no engine (rows made with tests/factories.py, samples pushed as the agent pushes them): the
page details a browser has to draw to show: the node's disk chart gives whole, distinct labels for a disk at
178.79 GiB; the commit id stays inside its card; a ready deployment's start-up card names the model's size in
binary units, not "0.00 GB"; the pages' script writes every size as the server does (a download read "0.1 GiB of
0.3 GiB" live where the page had loaded MiB)."""
import time

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from deployments import history
from deployments.modelfit import human_bytes
from tests.factories import DeploymentFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
GiB = 2**30


def _sample(t: float, disk_free: int, disk_total: int) -> dict:
    return {"t": t, "gpus": [], "disk": {"free": disk_free, "total": disk_total},
            "host": {"ram_available": 20 * GiB, "ram_total": 24 * GiB, "load1": 0.5, "cpu_percent": 12.0}}


def test_the_disk_chart_labels_a_nearly_full_disk_with_whole_distinct_ticks(logged_in_page):
    node = NodeFactory(last_heartbeat=timezone.now())
    total = 200 * GiB
    now = time.time()
    for i, free in enumerate((total - 178.79 * GiB, total - 178.80 * GiB, total - 178.79 * GiB)):
        history.push(node.pk, _sample(now - 3 + i, int(free), total))
    page = logged_in_page
    page.goto(f"{page.base_url}/nodes/{node.pk}/")
    page.wait_for_function("window.hostCharts && window.hostCharts.disk && window.hostCharts.disk.axes[1]._values")
    low, high = page.evaluate("[hostCharts.disk.scales.y.min, hostCharts.disk.scales.y.max]")
    assert low == 0 and high == pytest.approx(total / GiB)  # from nothing to the whole disk
    labels = [v for v in page.evaluate("hostCharts.disk.axes[1]._values") if v]
    assert len(labels) >= 3 and len(set(labels)) == len(labels), labels  # distinct
    assert all(len(v) <= 4 for v in labels), labels  # whole numbers that fit the axis ("200", not "178.79")


def test_the_commit_id_stays_on_one_line_inside_its_card(logged_in_page):
    model = ModelRepoFactory(repo_id="acme/tiny-chat", inspected=timezone.now(), commit="c" * 40)
    page = logged_in_page
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(f"{page.base_url}/models/{model.pk}/")
    commit = page.locator("#commit")
    expect(commit).to_have_attribute("title", "c" * 40)  # the whole id on hover
    card = commit.locator("xpath=ancestor::div[contains(@class, 'card')][1]").bounding_box()
    box, label = commit.bounding_box(), page.locator("dt", has_text="Commit").bounding_box()
    assert box["x"] + box["width"] <= card["x"] + card["width"], (box, card)
    assert box["height"] < 1.5 * label["height"], (box, label)  # clipped, not wrapped over lines
    assert page.evaluate("document.getElementById('commit').scrollWidth > document.getElementById('commit').clientWidth")


def test_a_ready_deployments_start_up_card_names_the_models_size_in_binary_units(logged_in_page):
    copy = ModelCopyFactory(path="/models/acme--tiny-chat")
    d = DeploymentFactory(model=copy.model, node=copy.node, status="ready", ready_at=timezone.now(), load_detail={
        "phases": {"segments": [["process", 0, 2.0], ["weights", 2.0, 3.0]], "totals": {"process": 2.0, "weights": 1.0}},
        "basis": "phases only", "ram_available": int(21.41 * 10**9), "model_bytes": 3_774_873})
    page = logged_in_page
    page.goto(f"{page.base_url}/deployments/{d.pk}/")
    expect(page.locator("#loading-title")).to_have_text("Start-up")
    expect(page.locator("#load-disk")).to_have_text("free RAM 19.9 GiB for a 3.6 MiB model")


def test_the_pages_script_writes_every_size_as_the_server_does(logged_in_page):
    page = logged_in_page
    page.goto(f"{page.base_url}/")
    sizes = [0, 512, 99_999, 100_000, 3.5 * 2**20, 10**8, 0.3 * GiB, 1023.96 * 2**20, GiB, 68.4 * GiB, 99.96 * GiB,
             547 * GiB, 1016 * GiB]
    assert page.evaluate("(sizes) => sizes.map(window.humanBytes)", sizes) == [human_bytes(n) for n in sizes]


def test_engine_now_shows_a_ready_engines_figures_and_not_the_last_engines_while_a_new_start_loads(logged_in_page):
    from deployments import payloads
    from deployments.models import Deployment
    from deployments.node import steps
    from deployments.timeline import deployment_event

    d = DeploymentFactory(status="ready", ready_at=timezone.now())
    figures = payloads.EngineFigures(id=d.pk, name=d.name, tok_s=116.9, running=0, waiting=0, kv_cache=0.0)
    payloads.send_engine_figures(d.node_id, figures)  # kept: the page's first snapshot holds it
    page = logged_in_page
    page.goto(f"{page.base_url}/deployments/{d.pk}/")
    expect(page.locator("#engine-now")).to_contain_text("116.9 tok/s")
    steps.move(Deployment.objects.get(pk=d.pk), "queued")  # a redeploy: a new start
    expect(page.locator("#status")).to_have_text("Queued")
    expect(page.locator("#engine-now")).to_have_text("—")
    payloads.send_engine_figures(d.node_id, figures)  # the last engine's reading, sent late
    page.reload()  # a page opened during the new start: its snapshot holds the last engine's figures
    # A step published now comes after the snapshot on the same feed: once it shows, the figures have come too.
    step = deployment_event(Deployment.objects.get(pk=d.pk), "prepare", "a step after the snapshot")
    expect(page.locator(f'#timeline tr[data-event="{step.pk}"]')).to_be_visible()
    expect(page.locator("#engine-now")).to_have_text("—")
