"""The study page in a real browser: an operator counts and starts a study in the form, watches the
variant × level matrix fill in live, reads the verdicts, and applies a winner that sets an NCCL
debugging variable only after confirming. A real node agent drives it with tests/faults' fake vLLM
(loads in half a second, streams tokens; for the first test on tests/schedserver.py schedules that make one
verdict certain), so the page, not the engine, is what is tested here."""
import json
import sys

import pytest
from playwright.sync_api import expect

from benchmarks.models import Study
from deployments.models import Deployment
from deployments.services import deploys
from tests.conftest import free_port, in_thread, wait_until
from tests.truestate import Agent, add_fake_model, agent_env, set_load, stop_leftover_engines

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


# The first token's wait tells a study's variants apart by a wide margin: 200 ms at the baseline's --max-num-seqs 4,
# 5 ms at 16 (tests/schedserver.py, by way of the fake engine), then a token every 2 ms. A trial's median TTFT would
# have to come 120 ms late, in one trial and not another, for the verdict on it to turn (3 repeats).
SCHEDULES = {"4": {"ttft_ms": 200, "gap_ms": 2}, "16": {"ttft_ms": 5, "gap_ms": 2}}


def deployed(process_env, spawn, unique, tmp_path, schedules=None):
    """A ready deployment (--max-num-seqs 4) of the fake engine, driven by a real agent; with `schedules`, the fake
    engine streams through tests/schedserver.py on the schedule of its --max-num-seqs."""
    folder = tmp_path / "fake-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                    "hidden_size": 64, "num_hidden_layers": 2,
                                                    "num_attention_heads": 2, "vocab_size": 256}))
    set_load(folder, 0.5)
    extra = {}
    if schedules:
        (folder / "fake_engine.json").write_text(json.dumps({"load_s": 0.5, "python": sys.executable,
                                                             "schedules": schedules}))
        # The schedule server runs on this venv's Python (under /root, which the engine user cannot enter).
        extra["PANEL_ENGINE_USER"] = "root"
    agent = Agent(spawn, agent_env(process_env, tmp_path, **extra), f"tune-{unique}", tmp_path / "store")
    node = agent.start()
    model = in_thread(add_fake_model, node, folder)
    d = in_thread(deploys.deployment_create, model=model, node=node, gpu_indices=[], port=free_port(),
                  engine_args={"served-model-name": "fake", "max-num-seqs": 4}, env={}, name=f"fake-{unique}")
    wait_until(lambda: Deployment.objects.get(pk=d.pk).status == "ready", timeout=60, message="the fake deployment")
    yield d
    agent.kill()  # first, so it starts no engine (the last redeploy) after the check below
    stop_leftover_engines(tmp_path)


@pytest.fixture
def fake_deployment(process_env, spawn, unique, tmp_path):
    yield from deployed(process_env, spawn, unique, tmp_path)


@pytest.fixture
def scheduled_deployment(process_env, spawn, unique, tmp_path):
    yield from deployed(process_env, spawn, unique, tmp_path, SCHEDULES)


def fill_study_form(page, d, **fields):
    """The new-study form for deployment `d` with `fields` (id_<name>: value), then Preview."""
    page.goto(f"{page.base_url}/benchmarks/studies/")
    page.select_option("#id_deployment", str(d.pk))
    for name, value in fields.items():
        page.fill(f"#id_{name}", value)
    page.click("#preview-button")


@pytest.mark.slow
def test_a_study_started_on_the_page_fills_its_matrix_live_and_applies_a_winner_with_confirmation(
        logged_in_page, scheduled_deployment):
    """Slow (about a minute and a half here): nine trials, a redeploy each, three of them on the baseline's schedule
    whose first token waits 200 ms for each of its 42 requests: the margin that makes the TTFT verdict certain."""
    page, d = logged_in_page, scheduled_deployment
    # Every count of filled cells the study's page shows, as it shows it: the browser's own record, not a race
    # between this test's reads and the trials.
    page.add_init_script("""window.matrixCounts = [];
        new MutationObserver(() => {
          const n = document.querySelectorAll("#matrix span[data-tok-s]").length;
          if (window.matrixCounts[window.matrixCounts.length - 1] !== n) window.matrixCounts.push(n);
        }).observe(document, {childList: true, subtree: true});""")
    fill_study_form(page, d, dimensions="NCCL_PROTO=LL,Simple\nmax-num-seqs=16", levels="1,4", max_tokens="16",
                    requests_per_user="2", repeats="3")
    expect(page.locator("#preview")).to_contain_text("3 variants")
    expect(page.locator("#preview")).to_contain_text("9 trials")
    page.click("#start")
    expect(page.locator("h1")).to_contain_text("tuning")
    study = Study.objects.latest("pk")
    cells = lambda: page.evaluate("window.studyView.cells()")  # noqa: E731
    expect(page.locator("#study-status")).to_have_text("Done", timeout=240_000)
    # 3 variants x 2 levels x 3 repeats; a trial that did not end done says why.
    assert cells() == 18, [(t.variant.name, t.repeat, t.status, t.error, t.run_id and t.run.status)
                           for t in study.trials.select_related("variant", "run")]
    # It filled in as trials landed, not at the end: the page showed part of the matrix, and never less than before.
    counts = page.evaluate("window.matrixCounts")
    assert counts[-1] == 18 and counts == sorted(counts) and any(0 < n < 18 for n in counts), counts
    expect(page.locator("#verdicts tbody tr").first).to_be_visible()
    # Each variant is named once: a name that is its flags is not followed by the same flags ("--max-num-seqs 16"
    # was printed twice), and the baseline is not "baseline (baseline)".
    names = page.locator("#matrix tbody td:first-child").all_inner_texts()
    assert names[0].strip() == "baseline" and all(len(set(n.split("\n"))) == len(n.split("\n")) for n in names), names
    # Each verdict shown is the one the study's results hold for that variant and figure; and the schedules decide
    # one of them: both variants' first token comes 195 ms sooner, so their TTFT is better at both levels.
    study.refresh_from_db()
    results = {v["id"]: v for v in study.results["variants"]}
    rows = page.locator("#verdicts tbody tr[data-key]").all()
    assert len(rows) == sum(1 for v in results.values() for est in v["estimates"].values() if est)
    for tr in rows:
        variant, key = results[int(tr.get_attribute("data-variant"))], tr.get_attribute("data-key")
        held = variant["comparisons"].get(key)
        label = tr.locator("td.verdict").inner_text().splitlines()[0]
        assert label == ("baseline" if variant["is_baseline"] else held["verdict"] if held else "—"), (key, label)
    for v in results.values():
        if not v["is_baseline"]:
            for key in ("ttft_median_ms@1", "ttft_median_ms@4"):
                shown = page.locator(f'#verdicts tr[data-variant="{v["id"]}"][data-key="{key}"] td.verdict')
                expect(shown).to_have_text("better")
    expect(page.locator("#pareto tbody tr")).to_have_count(6)
    assert page.evaluate("window.studyView.drawn()") == 6  # the chart draws what the table lists
    expect(page.locator("#pareto th[data-gpu]")).to_be_hidden()  # a CPU node: no per-GPU figures
    expect(page.locator("#rule")).to_have_text("The highest output tok/s at concurrency 4, if significantly better "
                                               "than the baseline's (else the baseline stays)")
    expect(page.locator("#estimate")).to_contain_text("took")
    # The winner at each level, by the same rule: one row per level, named as the study's results name it.
    expect(page.locator("#level-winners tbody tr")).to_have_count(2)
    shown = page.locator("#level-winners tbody td:nth-child(2)").all_inner_texts()
    assert shown == [w["name"] or "—" for w in study.results["per_level"]["levels"]]
    # Apply NCCL_PROTO=LL: it is a debugging variable, so the page asks for a confirmation first.
    ll = next(v for v in study.variants.all() if v.env.get("NCCL_PROTO") == "LL")
    page.select_option("#apply-variant", str(ll.pk))
    expect(page.locator("#debug-warning")).to_contain_text("NCCL_PROTO")
    page.click("#apply")
    expect(page.locator(".messages")).to_contain_text("tick the confirmation")
    assert Deployment.objects.get(pk=d.pk).env.get("NCCL_PROTO") is None
    page.select_option("#apply-variant", str(ll.pk))
    page.check("#confirm-debug")
    page.click("#apply")
    expect(page.locator(".messages")).to_contain_text("Redeploying", timeout=30_000)  # on the deployment's page
    assert Deployment.objects.get(pk=d.pk).env.get("NCCL_PROTO") == "LL"


def test_a_one_repeat_study_measures_but_gives_no_verdict_and_keeps_the_baseline(logged_in_page, fake_deployment):
    """What a newcomer meets trying a study with the form's smallest numbers: one repeat measures each variant,
    but no verdict can be drawn from it (the preview says so first), so the baseline stays."""
    page, d = logged_in_page, fake_deployment
    fill_study_form(page, d, variants="max-num-seqs=8", levels="1", max_tokens="16", requests_per_user="1", repeats="1")
    expect(page.locator("#preview")).to_contain_text("no verdict")
    page.click("#start")
    expect(page.locator("#study-status")).to_have_text("Done", timeout=180_000)
    verdicts = page.locator("#verdicts td.verdict").all_inner_texts()
    assert verdicts and all(v == "baseline" or v.startswith("no verdict") for v in verdicts), verdicts
    expect(page.locator("#winner")).to_contain_text("the baseline stays")
    assert page.evaluate("window.studyView.drawn()") == 2  # the Pareto chart draws its two points
    assert Deployment.objects.get(pk=d.pk).engine_args["max-num-seqs"] == 4  # the baseline's settings again
