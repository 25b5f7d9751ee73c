"""Every page tells the current truth: actions by state, flags as the command line, timeline rows that
end, sizes with their unit. Each case is one a newcomer met: a regression test per stale state."""
import re

import pytest

from deployments.models import Deployment, ModelCopy
from deployments.services import deploys
from tests.factories import BenchmarkRunFactory, DeploymentFactory, ModelCopyFactory

pytestmark = pytest.mark.django_db


def _button(page: str, action: str) -> str:
    start = page.index(f'data-action="{action}"')
    return page[start:page.index(">", start)]


def test_a_ready_copy_offers_only_delete_and_delete_asks_first(operator_client):
    copy = ModelCopyFactory(state=ModelCopy.State.READY)
    page = operator_client.get(f"/models/{copy.model.pk}/").content.decode()
    assert "hidden" in _button(page, "cancel") and "hidden" in _button(page, "retry")
    assert "hidden" not in _button(page, "delete") and "data-confirm=" in _button(page, "delete")


def test_a_downloading_copy_offers_cancel_only(operator_client):
    copy = ModelCopyFactory(state=ModelCopy.State.DOWNLOADING)
    page = operator_client.get(f"/models/{copy.model.pk}/").content.decode()
    assert "hidden" not in _button(page, "cancel")
    assert "hidden" in _button(page, "retry") and "hidden" in _button(page, "delete")


def test_a_stopped_deployment_offers_no_stop(operator_client):
    d = DeploymentFactory(status=Deployment.Status.STOPPED)
    page = operator_client.get(f"/deployments/{d.pk}/").content.decode()
    assert "hidden" in _button(page, "stop")
    running = DeploymentFactory(status=Deployment.Status.READY)
    page = operator_client.get(f"/deployments/{running.pk}/").content.decode()
    assert "hidden" not in _button(page, "stop") and "data-confirm=" in _button(page, "stop")


def _flags_in(page: str, marker: str) -> list[str]:
    """The flags of the <code> element that holds `marker`, each with its value, sorted."""
    code = next(text for text in re.findall(r"<code[^>]*>(.*?)</code>", page, re.S) if marker in text)
    return sorted(("--" + part).strip() for part in code.split("--") if part.strip())


def test_engine_flags_show_as_the_command_line_keeping_every_value(operator_client):
    d = DeploymentFactory(engine_args={"tensor-parallel-size": 1, "gpu-memory-utilization": 0.9, "enforce-eager": True})
    page = operator_client.get(f"/deployments/{d.pk}/").content.decode()
    # PostgreSQL's jsonb keeps no key order: compare the flags, not their order
    assert _flags_in(page, "--tensor-parallel-size") == ["--enforce-eager", "--gpu-memory-utilization 0.9",
                                                          "--tensor-parallel-size 1"]


def test_the_compare_page_shows_a_switch_without_true(viewer_client):
    a = BenchmarkRunFactory(environment={"engine_args": {"enforce-eager": True, "max-num-seqs": 8}})
    b = BenchmarkRunFactory(environment={"engine_args": {"enforce-eager": True}})
    page = viewer_client.get(f"/benchmarks/compare/?runs={a.pk}&runs={b.pk}").content.decode()
    assert _flags_in(page, "--max-num-seqs") == ["--enforce-eager", "--max-num-seqs 8"]
    assert "--enforce-eager True" not in page


def test_what_changed_on_the_compare_page_reads_as_the_command_line(viewer_client):
    a = BenchmarkRunFactory(environment={"engine_args": {"enforce-eager": True, "max-num-seqs": 8}})
    b = BenchmarkRunFactory(environment={"engine_args": {"max-num-seqs": 16}})
    page = viewer_client.get(f"/benchmarks/compare/?runs={a.pk}&runs={b.pk}").content.decode()
    diff = page[page.index('id="diff"'):page.index("</table>", page.index('id="diff"'))]
    assert '<code class="cmdline">--enforce-eager</code>' in diff and "True" not in diff
    assert '<code class="cmdline">--max-num-seqs 8</code>' in diff and '<code class="cmdline">--max-num-seqs 16</code>' in diff


def test_a_queued_row_in_the_timeline_is_a_moment_not_a_step_left_open(operator_client):
    d = DeploymentFactory(status=Deployment.Status.STOPPED)
    queued = deploys.deployment_event(d, "queued", "Queued.")
    step = deploys.deployment_event(d, "load", "…", ongoing=True)
    assert queued.ended == queued.started and step.ended is None
    page = operator_client.get(f"/deployments/{d.pk}/").content.decode()
    timeline = page[page.index('id="timeline"'):page.index("</table>", page.index('id="timeline"'))]
    assert "…</td>" not in timeline.replace("<td>…</td>", "")  # no TOOK cell waits forever on a stopped deployment


def test_every_figure_on_the_run_page_has_a_definition_one_hover_away(viewer_client):
    import re

    run = BenchmarkRunFactory(environment={})
    page = viewer_client.get(f"/benchmarks/{run.pk}/").content.decode()
    heads = re.findall(r"<th[ >][^>]*>", page[page.index('id="points"'):page.index("</thead>", page.index('id="points"'))])
    assert len(heads) >= 14 and all('title="' in th for th in heads)
    assert "ITL per token med" in page and "ITL per chunk med" in page  # both, labelled
    assert 'id="single-stream" title="Decode rate at concurrency 1' in page and "output incl. TTFT" in page


def test_a_user_changes_their_own_password_on_the_account_page(client, viewer):
    viewer.set_password("old-password-123")
    viewer.save()
    viewer_client = client
    viewer_client.force_login(viewer)
    wrong = viewer_client.post("/account/", {"old_password": "nope", "new_password1": "N3w-pass-long!",
                                             "new_password2": "N3w-pass-long!"})
    assert wrong.status_code == 400 and 'id="password-form"' in wrong.content.decode()
    done = viewer_client.post("/account/", {"old_password": "old-password-123", "new_password1": "N3w-pass-long!",
                                            "new_password2": "N3w-pass-long!"})
    assert done.status_code == 302
    viewer.refresh_from_db()
    assert viewer.check_password("N3w-pass-long!")
    assert viewer_client.get("/account/").status_code == 200  # the session survived the change


def test_default_benchmark_levels_stop_at_what_the_deployment_runs_at_once(operator_client):
    from benchmarks import selectors

    cpu = DeploymentFactory(engine_args={"max-num-seqs": 16})
    assert selectors.default_levels(cpu) == [1, 2, 4, 8, 16]
    assert max(selectors.default_levels(DeploymentFactory(engine_args={}))) == 64  # a CPU node without the flag
    page = operator_client.get(f"/benchmarks/?deployment={cpu.pk}").content.decode()
    assert 'value="1,2,4,8,16"' in page
