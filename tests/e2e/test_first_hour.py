"""The first hour on the real CPU engine: a newcomer's journey in Chromium that changes no field from
its default and calls the deployment with the official openai client as the page shows, and is refused
what cannot work (a repo the hub does not know, a model that does not fit) before anything is left behind."""
import importlib.util
import os
import shutil
import subprocess
import sys

import httpx
import pytest
from playwright.sync_api import expect

from benchmarks import runner
from benchmarks.models import BenchmarkRun
from deployments.host import processes
from deployments.models import Deployment, ModelCopy, ModelRepo, Node
from plumbing import tokens as api_tokens
from tests.conftest import ENGINE_VENV, wait_until
from tests.e2e.conftest import start_cpu_node
from tests.e2e.test_cli import panelctl
from tests.e2e.test_gateway import start_gateway
from tests.hfserver import get_stats, serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
LOAD_TIMEOUT_MS = 300_000  # a CPU engine starts in ~25-70 s on 2 shared cores
RUN_TIMEOUT_MS = 300_000


HUGE = 40 * 2**30  # weights no CPU node here holds in RAM (24 GiB)


@pytest.fixture
def hub_with_tiny_model(tmp_path, tiny_model):
    """A Hugging Face-compatible server holding the tiny model as acme/tiny-chat, and as acme/huge-chat the
    same files but weights of 40 GiB (a Git LFS pointer: the hub lists the size, no such file is on disk)."""
    repo = tmp_path / "hub" / "acme" / "tiny-chat"
    shutil.copytree(tiny_model, repo)
    huge = tmp_path / "hub" / "acme" / "huge-chat"
    shutil.copytree(tiny_model, huge, ignore=shutil.ignore_patterns("*.safetensors"))
    (huge / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n"
                                            f"oid sha256:{'0' * 64}\nsize {HUGE}\n")
    with serve(tmp_path / "hub") as url:
        yield url


def _refused_and_nothing_left(page, env, node, hub):
    """A repo id and a revision the hub does not know leave no row; a model that does not fit the node gets
    Deploy off on its page, a 409 from the API and exit 3 from panelctl, each naming the fit, and no download."""
    page.goto(f"{page.base_url}/models/")
    for repo_id, revision, said in (("acme/does-not-exist", "", "was not found"),
                                    ("acme/tiny-chat", "no-such-revision", "Revision 'no-such-revision' does not exist")):
        page.fill("#add-model input[name=repo_id]", repo_id)
        page.fill("#add-model input[name=revision]", revision)
        page.click("#add-model button[type=submit]")
        expect(page.locator("#add-model .errorlist")).to_contain_text(said)
        assert not ModelRepo.objects.filter(repo_id=repo_id).exists(), f"{repo_id}@{revision} left a row"

    page.goto(f"{page.base_url}/models/")
    page.fill("#add-model input[name=repo_id]", "acme/huge-chat")
    page.fill("#add-model input[name=revision]", "")
    page.click("#add-model button[type=submit]")
    expect(page.locator("#size")).to_contain_text("40.0 GiB", timeout=60_000)
    expect(page.locator("#fits")).to_contain_text("does not fit: needs ~44.0 GiB of RAM")
    huge = ModelRepo.objects.get(repo_id="acme/huge-chat")
    page.click("#deploy-button")
    expect(page.locator("#deploy-submit")).to_be_disabled()
    expect(page.locator("#fit-refusal")).to_contain_text("Deploy is off: does not fit: needs ~44.0 GiB of RAM")

    answer = httpx.post(f"{env['PANEL_URL']}/api/deployments/", json={"model": huge.pk, "node": node.name},
                        headers={"Authorization": f"Token {env['PANEL_TOKEN']}"}, timeout=30)
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "does_not_fit", answer.text
    assert "acme/huge-chat does not fit" in answer.json()["error"]["message"]
    code, _, err = panelctl(env, "deploy", "acme/huge-chat")
    assert code == 3 and "does not fit" in err, err
    assert not Deployment.objects.filter(model=huge).exists() and not ModelCopy.objects.filter(model=huge).exists()
    fetched = [r["path"] for r in get_stats(hub)["requests"]]  # nothing is downloaded before this point
    assert "model.safetensors" not in fetched, fetched


def _openai_python() -> str:
    """A Python with the official openai client: the panel's own when it has one, else the engine's (vLLM needs it)."""
    return sys.executable if importlib.util.find_spec("openai") else str(ENGINE_VENV / "bin" / "python")


@pytest.mark.slow
def test_a_newcomer_goes_from_the_hub_to_two_compared_runs_without_changing_a_default(
        logged_in_page, hub_with_tiny_model, process_env, spawn, unique, tmp_path, settings, stop_engines, operator,
        live_server_asgi):
    """A download, a real engine load and two runs of the default sweep (~45 s each on 2 cores): the defaults and
    the whole way through are what is tested. (A study's page the newcomer meets next is in test_study_page.py, on
    the fake engine: its three loads would add ~2 minutes here and test nothing of the real engine.)"""
    url = hub_with_tiny_model
    settings.HF_ENDPOINT = url
    env = dict(process_env, HF_ENDPOINT=url)
    spawn([sys.executable, "-m", "celery", "-A", "controlpanel", "worker", "-Q", "control", "-n", f"control-{unique}@%h",
           "--pool", "threads", "--concurrency", "2", "--without-gossip", "--without-mingle"], env, name="control-worker")
    node, _, _ = start_cpu_node(env, spawn, unique, tmp_path, None)
    # The node's gateway, as `./panel start` runs it: the one door callers use (engines listen on loopback).
    gateway = start_gateway(spawn, env, node.name, host=Node.objects.get(pk=node.pk).address or "127.0.0.1")
    wait_until(lambda: Node.objects.get(pk=node.pk).gateway_port, timeout=30, message="the gateway's port")
    page = logged_in_page
    cli_env = {**os.environ, "PANEL_URL": live_server_asgi, "PANEL_TOKEN": api_tokens.issue(operator),
               "PANELCTL_CONFIG": str(tmp_path / "none.json")}

    # What cannot work is refused before anything is left behind.
    _refused_and_nothing_left(page, cli_env, node, url)

    # Add the model: its repo id is the one thing a newcomer types.
    page.goto(f"{page.base_url}/models/")
    page.fill("#add-model input[name=repo_id]", "acme/tiny-chat")
    page.click("#add-model button[type=submit]")
    expect(page.locator("#architecture")).to_have_text("LlamaForCausalLM", timeout=60_000)
    expect(page.locator("#fits")).to_contain_text("fits in RAM")  # the CPU node, weighed by its RAM
    expect(page.locator("#disk-check .badge.ok")).to_have_text("room")  # the disk check, before Download

    page.click("#download-form button[type=submit]")
    card = page.locator(".copy").first
    expect(card.locator('[data-f="state"]')).to_have_text("Ready", timeout=120_000)
    assert ModelCopy.objects.get(node=node).state == "ready"

    page.reload()  # the Deploy button shows once the model is read
    page.click("#deploy-button")
    page.click("#deploy-submit")
    expect(page.locator("#status")).to_have_text("Ready", timeout=LOAD_TIMEOUT_MS)
    expect(page.locator("#live-state")).to_have_text("live")
    deployment = Deployment.objects.get(node=node)
    assert deployment.engine_args.get("enforce-eager") is True  # the CPU preset, applied by the server

    # Call it as the page says: the model name it shows is the repo id, the base URL is the node's gateway, a
    # caller key is needed; its Python snippet, copied with its Copy button, runs as is with the official openai
    # client and a key made on the account page.
    expect(page.locator("#call-models .call-model")).to_have_text(["acme/tiny-chat"])
    expect(page.locator("#call-key")).to_contain_text("needed")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.click('button[data-copy="call-python"]')
    expect(page.locator('button[data-copy="call-python"]')).to_have_text("Copied")
    snippet = page.evaluate("navigator.clipboard.readText()")
    assert snippet == page.locator("#call-python").inner_text() and 'model="acme/tiny-chat"' in snippet
    assert f'base_url="{gateway}/v1"' in snippet  # the gateway, never the engine's own port
    page.goto(f"{page.base_url}/account/")
    page.fill("#id_name", "first key")
    page.click("#key-form button[type=submit]")
    secret = page.locator("#new-key-secret").text_content()
    no_key = subprocess.run([_openai_python(), "-c", snippet], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "NO_PROXY": "*", "OPENAI_API_KEY": "vcp-not-a-key"})
    assert no_key.returncode != 0 and "401" in no_key.stderr, no_key.stderr[-2000:]  # the gateway checks keys
    called = subprocess.run([_openai_python(), "-c", snippet], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "NO_PROXY": "*", "OPENAI_API_KEY": secret})
    assert called.returncode == 0 and called.stdout.strip(), called.stderr[-2000:]
    print(f"the openai client got {called.stdout.strip()[:80]!r}")

    for _ in range(2):
        page.goto(f"{page.base_url}/deployments/{deployment.pk}/")
        page.click("text=Benchmark…")
        expect(page.locator("#id_deployment")).to_have_value(str(deployment.pk))
        page.click("#run-form button[type=submit]")
        expect(page.locator("#run-status")).to_have_text("Done", timeout=RUN_TIMEOUT_MS)
        expect(page.locator("#now")).to_have_text("—")  # a finished run has nothing in flight
        expect(page.locator("#live-state")).to_have_text("live")
        first_row = page.locator('#points tr[data-concurrency="1"] [data-f="prompt-tokens"]')
        asked, measured = (float(x) for x in first_row.inner_text().split(" / "))
        assert asked == runner.spec_default("input_tokens") and abs(measured - asked) <= 2
        # No ITL cell reads 0.00 (chunks that arrive in one read share its gap), and the levels whose decode the client
        # saw have all three figures. A level may show "—" for all three: on a busy host the client can read a whole
        # answer at once (CI saw c=2's 32 answers each arrive in the read of their first token), a decode no client
        # timed, which the page leaves out rather than calling 0 (benchmarks/runner/stats.py timed_decode).
        rows = [tr.locator("td").all_inner_texts()[8:11] for tr in page.locator("#points tbody tr").all()]
        for tpot, itl_token, itl_chunk in rows:
            assert "0.00" not in (tpot, itl_token, itl_chunk), rows
            assert tpot == "—" or "—" not in (itl_token, itl_chunk), rows  # a TPOT comes with the gaps it was timed by
        assert any("—" not in row for row in rows), rows
        expect(page.locator("#saturation")).to_be_visible()  # "Saturated at c=…: …" or why not
    runs = list(BenchmarkRun.objects.filter(deployment=deployment).order_by("pk"))
    assert [r.status for r in runs] == ["done", "done"]
    levels = runs[0].params["levels"]
    # Levels that fit the node: at most 16 streams per core it reported (the row as it is now: the one read at the
    # start predates the agent's first heartbeat, and its 0 cores made this bound 64 where the node's 2 make it 32).
    cores = Node.objects.get(pk=node.pk).cpu_count
    assert cores, "the agent reported no cores"
    assert max(levels) <= max(8, 16 * cores) and max(levels) < 1024, (levels, cores)
    print(f"levels {levels}; measured {[p.concurrency for p in runs[0].points.all()]}; warnings {runs[0].warnings}")

    page.goto(f"{page.base_url}/benchmarks/")
    for run in runs:
        page.check(f'input[name=runs][value="{run.pk}"]')
    page.click("text=Compare selected")
    expect(page.locator("h1")).to_contain_text("Compare")
    for run in runs:
        expect(page.locator("body")).to_contain_text(f"#{run.pk} {run.name}")  # told apart even if named alike

    page.goto(f"{page.base_url}/deployments/{deployment.pk}/")
    page.once("dialog", lambda dialog: dialog.accept())  # Stop asks first
    page.click('button[data-action="stop"]')
    expect(page.locator("#status")).to_have_text("Stopped", timeout=60_000)
    expect(page.locator("#live-state")).to_have_text("live")  # right after the action, not "reconnecting"
    assert processes.members(Deployment.objects.get(pk=deployment.pk).pgid) == []
