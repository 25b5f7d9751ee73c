"""A sweep in a real browser: a control-plane Celery worker runs it against an OpenAI-compatible
server with a known schedule, and the run page's charts grow live, level by level."""
import sys

import pytest
from playwright.sync_api import expect

from benchmarks.models import BenchmarkRun
from tests.conftest import wait_until
from tests.schedserver import SchedServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture
def control_worker(process_env, spawn, unique):
    argv = [sys.executable, "-m", "celery", "-A", "controlpanel", "worker", "-Q", "control", "-n", f"control-{unique}@%h",
            "--pool", "threads", "--concurrency", "2", "--without-gossip", "--without-mingle", "--loglevel", "INFO"]
    return spawn(argv, process_env, name="control-worker")


def test_a_sweep_started_in_the_browser_grows_its_charts_live(logged_in_page, control_worker, settings):
    page = logged_in_page
    # 40 ms to the first token, then 20 ms per write of two token chunks (as vLLM's events reach a client on a
    # busy host: several to a read): each level lasts a few seconds.
    with SchedServer(ttft_ms=40, gap_ms=20, reasoning_tokens=8, chunks_per_write=2) as server:
        settings.BENCHMARK_URL_ALLOWLIST = [server.base_url]  # an admin allowed this server
        page.goto(f"{page.base_url}/benchmarks/")
        page.fill("#id_base_url", server.base_url)
        page.fill("#id_levels", "1,4,16")
        page.fill("#id_max_tokens", "48")
        page.fill("#id_requests_per_user", "2")
        page.click("#run-form button[type=submit]")
        expect(page.locator("h1")).to_contain_text("http://127.0.0.1")
        run = BenchmarkRun.objects.latest("pk")
        ticks = lambda: page.evaluate("window.runCharts.ticks.data[0].length")  # noqa: E731
        levels = lambda: page.evaluate("window.runCharts.scaling.data[0].length")  # noqa: E731
        wait_until(lambda: ticks() >= 3, timeout=60, message="tok/s ticks on the chart")
        first = ticks()
        wait_until(lambda: levels() >= 1, timeout=60, message="the first level's point")
        wait_until(lambda: ticks() > first, timeout=60, message="more ticks while the run goes on")
        expect(page.locator("#run-status")).to_have_text("Done", timeout=120_000)
        expect(page.locator("#now")).to_have_text("—")  # a finished run has nothing in flight
        assert levels() == 3
        assert page.evaluate("window.runCharts.scaling.data[0]") == [1, 4, 16]
        row = page.locator('#points tr[data-concurrency="1"]')
        # 32 requests at c=1 (the minimum per level), 8 reasoning and 40 content tokens each.
        expect(row).to_contain_text("256 / 1280")
        expect(page.locator("#single-stream")).to_contain_text("tok/s")
        cells = row.locator("td").all_inner_texts()
        # Every level: TPOT > 0 and no ITL cell reads 0.00 (two chunks arrive together: one gap, two tokens), each
        # the level's stored figure.
        decode = {}
        for tr in page.locator("#points tbody tr").all():
            figures = [float(x) for x in tr.locator("td").all_inner_texts()[8:11]]
            assert all(x > 0 for x in figures), tr.inner_text()
            decode[int(tr.get_attribute("data-concurrency"))] = figures
        expect(page.locator("#saturation")).to_be_visible()  # saturated, or why not, once the run ends
        legends = " ".join(page.locator(".u-legend").all_inner_texts())
        assert "--" not in legends and "tok/s" in legends.lower()  # labels, not "s: --" placeholders
        assert page.locator("#chart-ticks").bounding_box()["y"] < page.locator("#environment").bounding_box()["y"]
    run.refresh_from_db()
    assert run.status == "done" and run.single_stream_tok_s > 0
    # The row shows what was measured, each figure in its column; and the records' order holds: the first content
    # token never before the first token. How close the figures come to the schedule is perf/bench_fidelity.py's.
    point = run.points.get(concurrency=1)
    shown = [float(x) for x in cells[5].split(" / ")] + [float(cells[6]), float(cells[7])]
    stored = [point.ttft_ms["median"], point.ttft_ms["p99"], point.ttft_vllm_bench_ms["median"], point.ttfc_ms["median"]]
    assert shown == pytest.approx(stored, abs=0.051)  # one decimal as the page rounds it
    # An order, not a timing: both come from the same 32 requests (each streamed content: 1,280 content tokens, 40
    # each), and each request's first content chunk is one of its token chunks, so at or after its first one. Every
    # order statistic of TTFC is then at or above TTFT's, whatever the host's speed; a TTFC taken from the wrong
    # chunk (the role chunk, which comes before any token) breaks it at some statistic.
    assert point.content_tokens == 32 * 40
    for statistic in ("median", "p90", "p99", "mean"):
        assert point.ttft_ms[statistic] <= point.ttfc_ms[statistic], statistic
    # Per-token ITL divides each gap between reads over the tokens the read brought. Every read brings at least one
    # whole write of two one-token chunks, so over a level the per-token gaps' mean (all gaps / all tokens after each
    # request's first read) is at most half the per-read gaps' mean (all gaps / all reads): an identity with the
    # writes' structure, where 10 ± 5 ms (20 ms a write over two tokens) was a race with the host.
    for p in run.points.all():
        assert decode[p.concurrency] == pytest.approx(
            [p.tpot_ms["median"], p.itl_per_token_ms["median"], p.itl_ms["median"]], abs=0.0051)  # two decimals
        assert p.itl_per_token_ms["mean"] <= p.itl_ms["mean"] / 2 * (1 + 1e-9), (p.itl_per_token_ms, p.itl_ms)
