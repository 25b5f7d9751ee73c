"""A copy's download through the Hub's transient failures: each kind the real Hub and its CDN give (a reset
mid-file, a stalled read, 5xx, 429 with Retry-After, an expired signed link) is retried from the kept bytes and the
copy ends ready and verified; a permanent error, failures in a row that bring no byte, or a file corrupt twice fail
it at once with their reason; a cancel ends the wait. Against tests/hfserver.py, the real download code and agent
side (deployments/modelcopies.py), on the test's thread."""
import shutil
import threading
from unittest import mock

import pytest

from deployments import modelcopies
from deployments.host import downloads
from deployments.models import ModelCopy, ModelRepo
from deployments.services import repos
from tests.conftest import wait_until
from tests.factories import NodeFactory
from tests.hfserver import configure, get_stats, reset_stats, serve
from tests.host.test_hub import MB, assert_same_tree, make_repo

pytestmark = pytest.mark.django_db(transaction=True)
SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The Hub double serving two repos: (its folder, its URL)."""
    root = tmp_path_factory.mktemp("retry-repos")
    make_repo(root, "org/flaky", [6 * MB, 2 * MB])
    make_repo(root, "org/corrupt", [3 * MB])
    with serve(root) as url:
        yield root, url
    shutil.rmtree(root)


@pytest.fixture
def hub_root(hub):
    return hub[0]


@pytest.fixture
def url(hub, settings):
    hub_url = hub[1]
    settings.HF_ENDPOINT = hub_url
    settings.DOWNLOAD_RETRY_FIRST_S = 0.1
    configure(hub_url, faults=[], throttle_bps=None)
    reset_stats(hub_url)
    yield hub_url
    configure(hub_url, faults=[], throttle_bps=None)


def _copy(tmp_path, repo_id="org/flaky") -> ModelCopy:
    model = ModelRepo.objects.create(repo_id=repo_id)
    repos.model_inspect(model.pk)
    node = NodeFactory(model_store=str(tmp_path / "store"))
    return ModelCopy.objects.create(model=model, node=node, state="queued", bytes_total=model.total_size)


def _download(copy: ModelCopy) -> ModelCopy:
    with mock.patch.object(downloads, "download", wraps=downloads.download) as tries:
        modelcopies.model_copy_download(copy.pk)
    row = ModelCopy.objects.get(pk=copy.pk)
    row.tries = tries.call_count
    return row


def test_a_connection_reset_mid_file_is_retried_and_the_copy_ends_ready(url, hub_root, tmp_path):
    copy = _copy(tmp_path)
    configure(url, faults=[{"kind": "reset", "after": 3 * MB, "path": SHARD}])
    row = _download(copy)
    assert row.state == "ready", row.error
    assert_same_tree(hub_root / "org/flaky", tmp_path / "store" / "org--flaky")
    asked = [r["range"] for r in get_stats(url)["requests"] if r["path"] == SHARD]
    assert asked == [None, f"bytes={3 * MB}-"], f"the retry fetched {asked}: not a resume from the kept bytes"
    assert row.tries == 2 and row.progress["retries"] == 1


def test_every_transient_failure_the_hub_gives_is_retried_and_a_429_waits_its_retry_after(url, hub_root, tmp_path,
                                                                                            monkeypatch):
    monkeypatch.setattr(downloads, "READ_TIMEOUT_S", 1.0)  # the stall outlasts it, as 60+ s outlast the real one
    faults = [{"kind": "status", "status": 503}, {"kind": "reset", "after": MB}, {"kind": "expired"},
              {"kind": "stall", "after": 2 * MB, "seconds": 3}, {"kind": "status", "status": 429, "retry_after": 1}]
    faults = [f | {"path": SHARD} for f in faults]  # each on the big shard: a small file could slip past a cut
    configure(url, faults=faults)
    copy = _copy(tmp_path)
    waits, real_wait = [], modelcopies._retry_wait

    def recorded(c, retries, reason, delay, deployment_id):
        waits.append((reason, delay))
        return real_wait(c, retries, reason, delay, deployment_id)

    with mock.patch("deployments.modelcopies._retry_wait", side_effect=recorded):
        row = _download(copy)
    assert row.state == "ready", row.error
    assert_same_tree(hub_root / "org/flaky", tmp_path / "store" / "org--flaky")
    stats = get_stats(url)
    assert sorted(stats["faults_served"]) == sorted(f["kind"] for f in faults) and not stats["faults_left"]
    assert row.progress["retries"] == len(faults) == len(waits)
    assert ("unavailable (HTTP 429)" in waits[-1][0]) and waits[-1][1] == 1.0, waits  # the server's Retry-After
    assert "HTTP 503" in waits[0][0] and "refused (HTTP 403)" in waits[2][0], waits


@pytest.mark.parametrize("status, code", [(404, "not_found"), (403, "gated")])
def test_a_permanent_error_fails_the_copy_at_once_with_its_reason(url, tmp_path, status, code):
    copy = _copy(tmp_path)
    configure(url, fail_status=status)
    try:
        row = _download(copy)
    finally:
        configure(url, fail_status=None)
    assert row.state == "failed" and row.error_code == code and row.tries == 1


def test_failures_in_a_row_that_bring_no_byte_fail_the_copy_naming_the_last_one(url, tmp_path, settings):
    settings.DOWNLOAD_RETRIES = 2
    copy = _copy(tmp_path)
    configure(url, fail_status=502)  # every request: no try brings a byte
    try:
        row = _download(copy)
    finally:
        configure(url, fail_status=None)
    assert row.state == "failed" and row.error_code == "unavailable" and row.tries == 3
    assert "HTTP 502" in row.error and "3 tries in a row brought no new byte" in row.error


def test_a_file_arriving_corrupt_twice_fails_the_copy(url, hub_root, tmp_path):
    copy = _copy(tmp_path, "org/corrupt")  # the copy's hashes are read now; the server then serves other bytes
    shard = hub_root / "org/corrupt/model-00001-of-00001.safetensors"
    with open(shard, "r+b") as f:
        f.seek(MB)
        f.write(b"corrupted!")
    row = _download(copy)
    assert row.state == "failed" and row.error_code == "corrupt" and row.tries == 2
    assert "checksum mismatch" in row.error and "twice" in row.error


def test_a_cancel_while_a_retry_waits_ends_the_copy_cancelled(url, tmp_path, settings):
    settings.DOWNLOAD_RETRY_FIRST_S = 600.0
    copy = _copy(tmp_path)
    configure(url, faults=[{"kind": "status", "status": 503, "path": SHARD}])
    worker = threading.Thread(target=modelcopies.model_copy_download, args=(copy.pk,), daemon=True)
    worker.start()
    shown = wait_until(lambda: (c := ModelCopy.objects.get(pk=copy.pk)).progress.get("retry") and c, timeout=30,
                       message="the retry's wait shown on the copy")
    # The copy stays alive while it waits: a deploy plan waiting on it (steps.model_ready) reads `updated`.
    wait_until(lambda: ModelCopy.objects.get(pk=copy.pk).updated > shown.updated, timeout=30,
               message="the copy's row touched during the wait")
    ModelCopy.objects.filter(pk=copy.pk).update(cancel_requested=True)
    worker.join(30)
    assert not worker.is_alive(), "the wait went on after the cancel"
    assert ModelCopy.objects.get(pk=copy.pk).state == "cancelled"
