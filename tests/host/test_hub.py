"""deployments.host.hub (metadata) and host.downloads against a local Hugging Face-compatible server (tests/hfserver.py)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from deployments.host import diskwrite, downloads, hub
from tests.conftest import free_port
from tests.hfserver import configure, get_stats, reset_stats, serve

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_test_secret_token_0123456789"
MB = 1_000_000
BIG = 210 * MB
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
          "num_hidden_layers": 32, "torch_dtype": "bfloat16"}
TOKENIZER = {"version": "1.0", "added_tokens": [{"id": 0, "content": "<s>", "special": True}],
             "model": {"type": "BPE", "vocab": {f"t{i}": i for i in range(2000)}, "merges": []}}


def write_random(path: Path, size: int) -> None:
    """Random-looking bytes, fast: one random block, each copy made unique by a counter."""
    block = bytearray(os.urandom(16 << 20))
    with open(path, "wb") as f:
        for i in range(0, size, len(block)):
            block[:8] = i.to_bytes(8, "little")
            f.write(block[: min(len(block), size - i)])


def make_repo(root: Path, repo_id: str, shards: list[int], token: str | None = None) -> Path:
    repo = root / repo_id
    repo.mkdir(parents=True)
    for i, size in enumerate(shards):
        write_random(repo / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", size)
    (repo / "config.json").write_text(json.dumps(CONFIG))
    (repo / "tokenizer.json").write_text(json.dumps(TOKENIZER))
    if token:
        (repo / ".gated").write_text(token)
    return repo


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def assert_same_tree(source: Path, dest: Path) -> None:
    files = sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file() and p.name != ".gated")
    for rel in files:
        assert sha256_of(dest / rel) == sha256_of(source / rel), rel
    assert not list((dest / downloads.PARTIAL_DIR).rglob("*.part"))


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("repos")
    make_repo(root, "org/model", [BIG, 20 * MB, 5 * MB])
    make_repo(root, "org/small", [24 * MB])
    make_repo(root, "org/gated", [2 * MB], token=TOKEN)
    make_repo(root, "org/corrupt", [3 * MB])
    yield root
    shutil.rmtree(root)  # a quarter GB; pytest would keep it around for a few runs


@pytest.fixture
def dest(tmp_path):
    yield tmp_path
    shutil.rmtree(tmp_path)


@pytest.fixture(scope="module")
def server_url(repos):
    with serve(repos) as url:
        yield url


@pytest.fixture
def url(server_url):
    defaults = {"throttle_bps": None, "fail_status": None, "drop_after": None, "ignore_range": False, "cdn": True}
    configure(server_url, **defaults)
    reset_stats(server_url)
    yield server_url
    configure(server_url, **defaults)


def fetched(url: str) -> int:
    return get_stats(url)["total"]


def test_repo_info_lists_files_with_sizes_hashes_commit_and_parsed_config(url, repos):
    info = hub.repo_info("org/model", endpoint=url)
    src = repos / "org/model"
    by_path = {f.path: f for f in info.files}
    assert set(by_path) == {p.name for p in src.iterdir()}
    assert len(info.commit) == 40 and info.revision == "main"
    shard = by_path["model-00001-of-00003.safetensors"]
    assert shard.size == BIG and shard.sha256 == sha256_of(src / shard.path) and shard.blob_id
    assert by_path["config.json"].sha256 is None and by_path["config.json"].blob_id
    assert info.config == CONFIG
    assert info.total_size == sum(p.stat().st_size for p in src.iterdir())
    assert hub.repo_info("org/model", revision=info.commit, endpoint=url).commit == info.commit


def test_hf_endpoint_points_everything_at_a_mirror(url, repos, dest, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", url)
    info = hub.repo_info("org/gated", token=TOKEN)
    downloads.download(info, dest, token=TOKEN)
    assert_same_tree(repos / "org/gated", dest)


def test_unknown_repo_is_a_permanent_not_found_error(url):
    with pytest.raises(hub.HubError) as e:
        hub.repo_info("org/nope", endpoint=url)
    assert e.value.code == "not_found" and e.value.permanent and "org/nope" in e.value.message


def test_missing_revision_is_a_permanent_revision_not_found_error(url):
    with pytest.raises(hub.HubError) as e:
        hub.repo_info("org/model", revision="v9", endpoint=url)
    assert e.value.code == "revision_not_found" and e.value.permanent and "v9" in e.value.message


def test_gated_repo_without_token_says_a_token_with_access_is_needed(url):
    with pytest.raises(hub.HubError) as e:
        hub.repo_info("org/gated", endpoint=url)
    assert e.value.code == "gated" and e.value.permanent and "token" in e.value.message


def test_a_gated_repo_is_listed_to_anyone_and_only_its_files_are_refused_as_on_the_real_hub(url):
    commit = hub.repo_check("org/gated", endpoint=url)  # the real Hub lists a gated repo without a token
    assert len(commit) == 40
    with pytest.raises(hub.HubError) as e:
        hub.repo_info("org/gated", endpoint=url)  # its config.json is a file: refused, with the gated message
    assert e.value.code == "gated"


def test_gated_repo_with_a_wrong_token_never_shows_the_token(url):
    wrong = "hf_wrong_token_abcdef123456"
    with pytest.raises(hub.HubError) as e:
        hub.repo_info("org/gated", token=wrong, endpoint=url)
    assert e.value.code == "gated" and "no access" in e.value.message
    assert wrong not in str(e.value) and wrong not in repr(e.value.args)


def test_gated_repo_with_its_token_downloads_through_the_cdn_redirect(url, repos, dest):
    info = hub.repo_info("org/gated", token=TOKEN, endpoint=url)
    assert info.config == CONFIG
    downloads.download(info, dest, token=TOKEN, endpoint=url)
    assert_same_tree(repos / "org/gated", dest)
    # The CDN answers 400 to a forwarded token, so the shard arriving proves it was dropped.
    assert get_stats(url)["served"]["org/gated/model-00001-of-00001.safetensors"] == 2 * MB


def test_server_down_is_a_transient_unavailable_error(dest):
    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(hub.HubError) as e:
        hub.repo_info("org/model", endpoint=down)
    assert e.value.code == "unavailable" and not e.value.permanent
    info = hub.RepoInfo("org/model", "main", "0" * 40, [hub.RepoFile("a.bin", 10, None, None)], None, 10)
    with pytest.raises(hub.HubError) as e:
        downloads.download(info, dest, endpoint=down)
    assert e.value.code == "unavailable" and not e.value.permanent


def test_server_errors_are_transient(url):
    configure(url, fail_status=503)
    with pytest.raises(hub.HubError) as e:
        hub.repo_info("org/model", endpoint=url)
    assert e.value.code == "unavailable" and not e.value.permanent


def test_full_download_verifies_every_file_and_leaves_no_partials(url, repos, dest):
    info = hub.repo_info("org/model", endpoint=url)
    reset_stats(url)
    seen: list[downloads.Progress] = []
    downloads.download(info, dest, endpoint=url, on_progress=seen.append)
    assert_same_tree(repos / "org/model", dest)
    assert fetched(url) == info.total_size
    assert seen[-1].bytes_done == seen[-1].bytes_total == info.total_size
    assert all(done == total for done, total in seen[-1].files.values())
    assert downloads.bytes_needed(info, dest) == 0

    reset_stats(url)
    downloads.download(info, dest, endpoint=url)
    assert fetched(url) == 0  # complete files are skipped


def test_a_tampered_file_is_fetched_again_when_verifying(url, repos, dest):
    info = hub.repo_info("org/small", endpoint=url)
    downloads.download(info, dest, endpoint=url)
    shard = dest / "model-00001-of-00001.safetensors"
    with open(shard, "r+b") as f:
        f.write(b"\0" * 16)
    reset_stats(url)
    downloads.download(info, dest, endpoint=url, verify=True)
    assert fetched(url) == 24 * MB
    assert_same_tree(repos / "org/small", dest)


def test_corrupt_data_from_the_server_is_rejected_and_not_kept(url, repos, dest):
    info = hub.repo_info("org/corrupt", endpoint=url)  # the server hashes the repo now, then serves other bytes
    shard = repos / "org/corrupt/model-00001-of-00001.safetensors"
    with open(shard, "r+b") as f:
        f.seek(MB)
        f.write(b"corrupted!")
    with pytest.raises(hub.HubError) as e:
        downloads.download(info, dest, endpoint=url)
    assert e.value.code == "corrupt" and shard.name in e.value.message
    assert not (dest / shard.name).exists()
    assert not (dest / downloads.PARTIAL_DIR / f"{shard.name}.part").exists()


class _Ticks(threading.Thread):
    """The download's thread, each wait of the caller's thread on it recorded: (timeout, still running after)."""

    waits: list[tuple[float | None, bool]] = []

    def join(self, timeout=None):
        super().join(timeout)
        self.waits.append((timeout, self.is_alive()))


def test_cancel_keeps_partials_and_a_second_call_resumes(url, repos, dest, monkeypatch):
    info = hub.repo_info("org/small", endpoint=url)
    configure(url, throttle_bps=8 * MB)
    seen: list[downloads.Progress] = []
    monkeypatch.setattr(_Ticks, "waits", [])
    monkeypatch.setattr(downloads, "threading", SimpleNamespace(Thread=_Ticks, Event=threading.Event, Lock=threading.Lock))

    with pytest.raises(downloads.DownloadCancelled):
        downloads.download(info, dest, endpoint=url, chunk_bytes=1 << 20, on_progress=seen.append,
                     should_cancel=lambda: seen[-1].bytes_done > 6 * MB)
    part = dest / downloads.PARTIAL_DIR / "model-00001-of-00001.safetensors.part"
    kept = part.stat().st_size
    assert kept > 5 * MB
    moving = [p for p in seen if p.rate_bps > 0]  # the time left follows from the rate the same report gives
    assert moving and all(p.seconds_left == pytest.approx((p.bytes_total - p.bytes_done) / p.rate_bps) for p in moving)
    assert seen[-1].current_file == "model-00001-of-00001.safetensors" and seen[-1].bytes_done > 6 * MB
    # A few reports per second at most: after the first, each one follows a wait of TICK_S on the download.
    assert _Ticks.waits and {timeout for timeout, _ in _Ticks.waits} == {downloads.TICK_S}
    assert len(seen) - 1 <= sum(running for _, running in _Ticks.waits)

    configure(url, throttle_bps=None)
    remaining = downloads.bytes_needed(info, dest)
    assert remaining <= info.total_size - kept
    reset_stats(url)
    downloads.download(info, dest, endpoint=url)
    assert fetched(url) <= remaining * 1.1
    assert_same_tree(repos / "org/small", dest)


def test_the_rate_is_the_bytes_received_over_the_last_window_and_the_time_left_follows_from_it(tmp_path, monkeypatch):
    files = [hub.RepoFile("a.safetensors", 100 * MB, None, None)]
    run = downloads._Download(hub.RepoInfo("org/a", "main", "c" * 40, files, None, 100 * MB), tmp_path, None, "http://x",
                              MB, 1)
    now = [1000.0]
    monkeypatch.setattr(downloads, "time", SimpleNamespace(monotonic=lambda: now[0]))
    assert run.progress().rate_bps == 0.0 and run.progress().seconds_left is None  # nothing received yet
    for t, received in ((1001.0, 4 * MB), (1002.0, 10 * MB), (1007.0, 40 * MB)):
        now[0], run.fetched["a.safetensors"] = t, received
        run.done["a.safetensors"] = received
        p = run.progress()
    # The window keeps RATE_WINDOW_S (5 s): the samples at 1000 and 1001 are dropped, 1002 (10 MB) is its start.
    assert p.rate_bps == pytest.approx((40 - 10) * MB / (1007 - 1002))
    assert p.seconds_left == pytest.approx(60 * MB / p.rate_bps) and p.bytes_done == 40 * MB


def test_a_broken_connection_keeps_the_partial_for_a_resume(url, repos, dest):
    info = hub.repo_info("org/small", endpoint=url)
    configure(url, drop_after=5 * MB)
    with pytest.raises(hub.HubError) as e:
        downloads.download(info, dest, endpoint=url)
    assert e.value.code == "unavailable" and not e.value.permanent
    part = dest / downloads.PARTIAL_DIR / "model-00001-of-00001.safetensors.part"
    assert part.stat().st_size == 5 * MB

    configure(url, drop_after=None)
    reset_stats(url)
    downloads.download(info, dest, endpoint=url)
    assert fetched(url) == 24 * MB - 5 * MB  # the small files had arrived whole
    assert_same_tree(repos / "org/small", dest)


def test_a_resume_reports_the_bytes_kept_on_disk_from_its_first_report_and_never_fewer(url, repos, dest):
    # The first hour's "39.5 % on the page while 72.7 % was on disk": a resume counted a partial only once its file's
    # turn came, and from 0 again while its prefix was hashed.
    info = hub.repo_info("org/model", endpoint=url)
    configure(url, drop_after=12 * MB)
    with pytest.raises(hub.HubError):
        downloads.download(info, dest, endpoint=url, workers=1)
    kept = info.total_size - downloads.bytes_needed(info, dest)
    assert kept >= 12 * MB

    configure(url, drop_after=None)
    seen: list[downloads.Progress] = []
    downloads.download(info, dest, endpoint=url, workers=1, chunk_bytes=1 << 20, on_progress=seen.append)
    assert seen[0].bytes_done == kept
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(seen, seen[1:])), [p.bytes_done for p in seen]
    assert seen[-1].bytes_done == info.total_size
    assert_same_tree(repos / "org/model", dest)


def test_a_server_ignoring_range_makes_the_resume_start_over(url, repos, dest):
    info = hub.repo_info("org/small", endpoint=url)
    configure(url, drop_after=5 * MB)
    with pytest.raises(hub.HubError):
        downloads.download(info, dest, endpoint=url)
    configure(url, drop_after=None, ignore_range=True)
    reset_stats(url)
    downloads.download(info, dest, endpoint=url)
    assert fetched(url) == 24 * MB
    assert_same_tree(repos / "org/small", dest)


def test_disk_full_midway_keeps_what_was_written(url, repos, dest):
    info = hub.repo_info("org/small", endpoint=url)
    budget = [10 * MB]
    real_write_all = diskwrite.write_all

    def write_until_full(fd, block):
        data = b"".join(block)
        if len(data) > budget[0]:
            os.write(fd, data[: budget[0]])
            budget[0] = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        budget[0] -= len(data)
        real_write_all(fd, block)

    with mock.patch.object(diskwrite, "write_all", side_effect=write_until_full):
        with pytest.raises(hub.HubError) as e:
            downloads.download(info, dest, endpoint=url, chunk_bytes=1 << 20, workers=1)
    assert e.value.code == "disk_full" and e.value.permanent
    assert (dest / downloads.PARTIAL_DIR / "model-00001-of-00001.safetensors.part").stat().st_size == 10 * MB

    reset_stats(url)
    downloads.download(info, dest, endpoint=url)
    assert fetched(url) <= (info.total_size - 10 * MB) * 1.1
    assert_same_tree(repos / "org/small", dest)


def test_a_second_download_into_the_same_folder_is_refused_while_one_runs(url, dest):
    import fcntl

    info = hub.repo_info("org/small", endpoint=url)
    (dest / downloads.PARTIAL_DIR).mkdir()
    with open(dest / downloads.PARTIAL_DIR / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(hub.HubError) as e:
            downloads.download(info, dest, endpoint=url)
    assert e.value.code == "busy" and not e.value.permanent


def test_a_repo_listing_a_path_outside_the_folder_is_refused(dest):
    info = hub.RepoInfo("org/evil", "main", "0" * 40, [hub.RepoFile("../escape.txt", 3, None, None)], None, 3)
    with pytest.raises(hub.HubError) as e:
        downloads.download(info, dest / "dest", endpoint="http://127.0.0.1:9")
    assert e.value.code == "bad_metadata" and not (dest / "escape.txt").exists()


DOWNLOAD_SCRIPT = """
import sys
from pathlib import Path
from deployments.host import downloads, hub
info = hub.repo_info("org/model", endpoint=sys.argv[1])
downloads.download(info, Path(sys.argv[2]), endpoint=sys.argv[1])
"""


def test_a_killed_download_resumes_without_fetching_again_what_it_had(url, repos, dest):
    info = hub.repo_info("org/model", endpoint=url)
    part = dest / downloads.PARTIAL_DIR / "model-00001-of-00003.safetensors.part"
    configure(url, throttle_bps=60 * MB)
    cmd = [sys.executable, "-c", DOWNLOAD_SCRIPT, url, str(dest)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not (part.exists() and part.stat().st_size >= BIG // 4):
            assert proc.poll() is None and time.monotonic() < deadline, "download ended before the kill"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    kept = part.stat().st_size
    assert BIG // 4 <= kept < BIG
    remaining = downloads.bytes_needed(info, dest)
    assert remaining <= info.total_size - kept

    configure(url, throttle_bps=None)
    reset_stats(url)
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=60)
    stats = get_stats(url)
    assert stats["total"] <= remaining * 1.1
    ranges = [r["range"] for r in stats["requests"] if r["path"] == part.name[:-5]]
    assert ranges and ranges[0].startswith("bytes=") and int(ranges[0][6:-1]) >= BIG // 4
    assert_same_tree(repos / "org/model", dest)


def test_a_finished_download_leaves_no_partial_folder(url, repos, dest):
    info = hub.repo_info("org/small", endpoint=url)
    downloads.download(info, dest, endpoint=url)
    assert not (dest / downloads.PARTIAL_DIR).exists()
    assert_same_tree(repos / "org/small", dest)
