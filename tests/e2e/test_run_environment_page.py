"""Real Chromium, no engine: a finished run's page lists its environment in short labelled lines (flags as on
the command line, variables as NAME=value, GPUs by name), never as a Python dict one word a line, and its
charts come first, in the window a user opens it in (rows made with tests/factories.py)."""
import pytest
from django.utils import timezone
from playwright.sync_api import expect

from tests.factories import BenchmarkPointFactory, BenchmarkRunFactory

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_a_runs_environment_reads_as_lines_below_its_charts(logged_in_page):
    environment = {"deployment": "qwen3-gpu-01", "engine_version": "0.32.0", "node": "gpu-01",
                   "engine_args": {"max-num-seqs": 64, "enforce-eager": True}, "env": {"NCCL_PROTO": "LL"},
                   "gpus": [{"index": 0, "name": "NVIDIA H200"}, {"index": 1, "name": "NVIDIA H200"}],
                   "engine_command": "vllm serve /models/qwen3 --max-num-seqs 64 --enforce-eager"}
    run = BenchmarkRunFactory(status="done", params={"levels": [1, 2]}, environment=environment,
                              started=timezone.now(), finished=timezone.now())
    for c in (1, 2):
        BenchmarkPointFactory(run=run, concurrency=c)
    page = logged_in_page
    page.set_viewport_size({"width": 1280, "height": 800})
    page.goto(f"{page.base_url}/benchmarks/{run.pk}/")
    env = page.locator("#environment")
    expect(env.locator("dd", has_text="--max-num-seqs 64 --enforce-eager")).to_be_visible()
    expect(env.locator("dd", has_text="NCCL_PROTO=LL")).to_be_visible()
    expect(env.locator("dd", has_text="0: NVIDIA H200, 1: NVIDIA H200")).to_be_visible()
    text = env.inner_text()
    assert "{" not in text and "': " not in text and "True" not in text, text  # not a dict's repr
    assert max(len(line) for line in text.splitlines()) < 120  # short lines, none a word wide
    chart = page.locator("#chart-ticks").bounding_box()
    assert chart["y"] < env.bounding_box()["y"] and chart["y"] < 800  # the charts first, in the first screen
