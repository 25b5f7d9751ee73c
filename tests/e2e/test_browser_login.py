"""Real Chromium against the real ASGI app: log in, see the fleet, get live updates."""
import re
import time

import pytest
from playwright.sync_api import expect

from deployments.services import nodes
from tests.conftest import in_thread
from tests.factories import GpuFactory, NodeFactory

pytestmark = pytest.mark.e2e


def test_a_user_logs_in_and_sees_the_dashboard(page, live_server_asgi, operator):
    page.goto(f"{live_server_asgi}/nodes/")
    expect(page).to_have_url(f"{live_server_asgi}/accounts/login/?next=/nodes/")
    page.fill("#id_username", operator.username)
    page.fill("#id_password", "wrong password")
    page.click("button[type=submit]")
    expect(page.locator(".errorlist")).to_contain_text("enter a correct username and password")
    page.fill("#id_password", "pw-for-tests-1")
    page.click("button[type=submit]")
    expect(page).to_have_url(f"{live_server_asgi}/nodes/")
    page.click("text=Nodes")
    expect(page.locator("h1")).to_have_text("Nodes")
    expect(page.locator(".empty")).to_contain_text("No nodes yet")
    page.click("text=Log out")
    expect(page).to_have_url(f"{live_server_asgi}/accounts/login/")


def test_the_dashboard_bar_follows_live_gpu_samples(logged_in_page, unique):
    page = logged_in_page
    node = NodeFactory(name=f"live-{unique}")
    GpuFactory(node=node, index=0, memory_total=100 * 2**30)
    page.goto(f"{page.base_url}/")
    expect(page.locator("h1")).to_have_text("Fleet")
    expect(page.locator("#live-state")).to_have_text("live")
    bar = page.locator(f'.node-card[data-node="{node.pk}"] [data-role="bar"]')
    in_thread(nodes.node_sample_record, node.pk, _sample(40), {})  # as the node's agent records it
    expect(bar).to_have_attribute("style", re.compile(r"width: 40(\.0)?%"))
    expect(page.locator(f'.node-card[data-node="{node.pk}"] [data-role="disk"]')).to_have_text("3.0 GiB of 8.0 GiB")
    in_thread(nodes.node_sample_record, node.pk, _sample(75), {})
    expect(bar).to_have_attribute("style", re.compile(r"width: 75(\.0)?%"))


def _sample(used_gib: int) -> dict:
    return {"t": time.time(), "nvml_error": "",
            "gpus": [{"index": 0, "memory_used": used_gib * 2**30, "memory_total": 100 * 2**30, "util_gpu": 10,
                      "temperature_c": 40, "power_w": 100.0}],
            "disk": {"total": 8 * 2**30, "free": 3 * 2**30, "used": 5 * 2**30},
            "host": {"ram_total": 1, "ram_available": 1, "load1": 0.0}}
