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


def test_a_run_of_repeats_shows_every_repeat_as_its_own_row_and_each_levels_median_with_its_interval(logged_in_page):
    from benchmarks import runrepeats

    run = BenchmarkRunFactory(status="done", params={"levels": [1, 4], "repeats": 3}, started=timezone.now(),
                              finished=timezone.now())
    for c in (1, 4):
        for repeat, tok_s in enumerate((100.0 * c, 104.0 * c, 98.0 * c)):
            BenchmarkPointFactory(run=run, concurrency=c, repeat=repeat, output_throughput=tok_s)
    run.over_repeats = runrepeats.run_repeats(run)
    run.save(update_fields=["over_repeats"])
    page = logged_in_page
    page.goto(f"{page.base_url}/benchmarks/{run.pk}/")
    rows = page.locator("#points tbody tr")
    expect(rows).to_have_count(6)  # keyed by level and repeat: no repeat hides another
    assert [rows.nth(i).locator("td").first.inner_text() for i in range(6)] == ["1", "1 #2", "1 #3", "4", "4 #2", "4 #3"]
    assert rows.nth(4).locator("td").nth(1).inner_text() == "416.0"
    median = page.locator('#repeat-figures tr[data-level="c=4"] td[data-metric="throughput"]')
    expect(median).to_contain_text("400.0")  # the median of 400, 416 and 392
    expect(median.locator('[data-f="interval"]')).to_be_visible()
