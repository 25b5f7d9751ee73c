"""Resumable, verified downloads of a repo's files from the Hugging Face Hub (or a mirror) into a folder.

Partial files and a ledger of what they belong to live in dest/.partial, so a broken or cancelled
download resumes where it stopped. Metadata (what to fetch): host/hub.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import aiohttp

from deployments.host import diskwrite
from deployments.host.hub import USER_AGENT, HubError, RepoFile, RepoInfo, endpoint_url, file_url, status_error

PARTIAL_DIR = ".partial"
CHUNK_BYTES = 8 << 20  # hashed and written as one block
WORKERS = 4  # files in flight at once
TICK_S = 0.5  # cadence of on_progress and should_cancel
RATE_WINDOW_S = 5.0
CONNECT_TIMEOUT_S = 15.0
READ_TIMEOUT_S = 60.0
MAX_RETRY_AFTER_S = 600.0  # a server's Retry-After is followed up to this


class DownloadCancelled(Exception):
    """The download stopped because should_cancel() said so; partials stay for a resume."""


@dataclass(frozen=True)
class Progress:
    """A download's state; files maps path to (bytes done, bytes total)."""

    bytes_done: int
    bytes_total: int
    files: dict[str, tuple[int, int]]
    rate_bps: float
    seconds_left: float | None
    current_file: str | None


def _check_path(path: str) -> None:
    p = PurePosixPath(path)
    if p.is_absolute() or not p.parts or ".." in p.parts or p.parts[0] == PARTIAL_DIR:
        raise HubError(f"The repo lists an unsafe file path: {path!r}.", True, "bad_metadata")


def _identity(f: RepoFile) -> str:
    return f"{f.sha256 or f.blob_id or ''}:{f.size}"


def _expected_digest(f: RepoFile) -> str | None:
    return f.sha256 or (f.blob_id if f.blob_id and len(f.blob_id) == 40 else None)


def _hasher(f: RepoFile):
    if f.sha256:
        return hashlib.sha256()
    if _expected_digest(f):
        return hashlib.sha1(b"blob %d\0" % f.size)  # the git object id of a non-LFS file
    return None


class _Ledger:
    """dest/.partial/state.json: which blob each partial belongs to, which files were verified."""

    def __init__(self, dest: Path):
        self.path = dest / PARTIAL_DIR / "state.json"
        self.lock = threading.Lock()
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        self.partials: dict[str, str] = data.get("partials", {})
        self.verified: dict[str, str] = data.get("verified", {})

    def update(self, path: str, partial: str | None = None, verified: str | None = None) -> None:
        with self.lock:
            for table, value in ((self.partials, partial), (self.verified, verified)):
                table.pop(path, None)
                if value:
                    table[path] = value
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"partials": self.partials, "verified": self.verified}))
            os.replace(tmp, self.path)


def _part_path(dest: Path, f: RepoFile) -> Path:
    return dest / PARTIAL_DIR / f"{f.path}.part"


def _usable_partial(dest: Path, f: RepoFile, ledger: _Ledger) -> int:
    if ledger.partials.get(f.path) != _identity(f):
        return 0  # none, or left by another revision of the file
    try:
        size = _part_path(dest, f).stat().st_size
    except OSError:
        return 0
    return size if size <= f.size else 0


def _is_complete(dest: Path, f: RepoFile) -> bool:
    try:
        return (dest / f.path).stat().st_size == f.size
    except OSError:
        return False


def bytes_needed(info: RepoInfo, dest: Path) -> int:
    """Bytes still to fetch into dest, counting complete files and usable partials."""
    dest, ledger = Path(dest), _Ledger(Path(dest))
    return sum(0 if _is_complete(dest, f) else f.size - _usable_partial(dest, f, ledger) for f in info.files)


def _disk_error(e: OSError, path: str) -> HubError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return HubError(f"The disk is full while writing {path}; what was written is kept.", True, "disk_full")
    return HubError(f"Cannot write {path}: {e.strerror or e}.", True, "io_error")


class _Stop(Exception):
    """Internal: another file failed or the caller cancelled."""


class _Download:
    """One run: an asyncio thread streams files over one aiohttp session, a thread pool hashes and
    writes blocks off the event loop, and the caller's thread reports progress and polls cancellation."""

    def __init__(self, info: RepoInfo, dest: Path, token: str | None, endpoint: str, chunk_bytes: int,
                 workers: int):
        self.info, self.dest, self.token, self.endpoint = info, dest, token, endpoint
        self.chunk_bytes, self.workers = chunk_bytes, workers
        self.ledger = _Ledger(dest)
        self.stop = threading.Event()
        self.done = {f.path: 0 for f in info.files}  # bytes on disk; one writer per key at a time
        self.fetched = {f.path: 0 for f in info.files}  # bytes received in this run
        self.active: dict[str, float] = {}
        self.errors: list[BaseException] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tasks: list[asyncio.Task] = []
        self.samples: deque[tuple[float, int]] = deque()

    def run(self, verify: bool, on_progress, should_cancel) -> None:
        todo = []
        for f in sorted(self.info.files, key=lambda f: -f.size):  # big files first: they set the pace
            _check_path(f.path)
            complete = _is_complete(self.dest, f)
            if complete and not verify and self.ledger.verified.get(f.path) == _identity(f):
                self.done[f.path] = f.size
            else:
                # What is on disk counts from the first report: a file to check, a partial to resume (its prefix is
                # hashed again when its turn comes, without counting it twice).
                self.done[f.path] = f.size if complete else _usable_partial(self.dest, f, self.ledger)
                todo.append((f, complete))
        if on_progress:
            on_progress(self.progress())
        if not todo:
            return
        thread = threading.Thread(target=self._thread_main, args=(todo,), name="hub-download", daemon=True)
        thread.start()
        cancelled = False
        try:
            while thread.is_alive():
                thread.join(TICK_S)
                if self.stop.is_set() or not thread.is_alive():
                    continue
                if should_cancel is not None and should_cancel():
                    cancelled = True
                    self.request_stop()
                elif on_progress:
                    on_progress(self.progress())
        finally:
            if thread.is_alive():  # the caller's thread was interrupted (e.g. a soft time limit)
                self.request_stop()
                thread.join()
        if self.errors:
            raise self.errors[0]
        if cancelled:
            raise DownloadCancelled(f"Download of {self.info.repo_id} cancelled; partial files are kept.")
        if on_progress:
            on_progress(self.progress())

    def progress(self) -> Progress:
        now, fetched = time.monotonic(), sum(self.fetched.values())
        self.samples.append((now, fetched))
        while len(self.samples) > 2 and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()
        t0, f0 = self.samples[0]
        rate = (fetched - f0) / (now - t0) if now > t0 else 0.0
        files = {f.path: (min(self.done[f.path], f.size), f.size) for f in self.info.files}
        done, total = sum(d for d, _ in files.values()), self.info.total_size
        current = min(self.active, key=self.active.get, default=None)
        return Progress(done, total, files, rate, (total - done) / rate if rate > 0 else None, current)

    def request_stop(self) -> None:
        self.stop.set()
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(lambda: [t.cancel() for t in self.tasks])
            except RuntimeError:
                pass  # the loop already closed: nothing left to cancel

    def _thread_main(self, todo) -> None:
        try:
            asyncio.run(self._main(todo))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self.errors.append(e)

    async def _main(self, todo) -> None:
        self.loop = asyncio.get_running_loop()
        headers = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        # aiohttp drops Authorization when a redirect leaves the origin (the Hub sends LFS files to a CDN).
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
        slots = asyncio.Semaphore(self.workers)
        with ThreadPoolExecutor(self.workers, thread_name_prefix="hub-io") as self.pool:
            async with aiohttp.ClientSession(headers=headers, timeout=timeout, read_bufsize=4 << 20,
                                             connector=aiohttp.TCPConnector(limit=self.workers)) as self.session:
                self.tasks = [asyncio.create_task(self._file(f, complete, slots)) for f, complete in todo]
                if self.stop.is_set():
                    self.request_stop()
                await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _file(self, f: RepoFile, complete: bool, slots: asyncio.Semaphore) -> None:
        try:
            async with slots:
                if self.stop.is_set():
                    return
                self.active[f.path] = time.monotonic()
                if complete and await self._blocking(self._matches, f):
                    self.ledger.update(f.path, verified=_identity(f))
                    return
                offset, hasher, fd = await self._blocking(self._open_partial, f)
                try:
                    if offset < f.size:
                        hasher = await self._stream(f, fd, offset, hasher)
                    await self._blocking(os.fsync, fd)
                finally:
                    os.close(fd)
                await self._blocking(self._finish, f, hasher)
        except (_Stop, asyncio.CancelledError):
            pass
        except BaseException as e:  # noqa: BLE001 - the first failure stops the others
            if not self.stop.is_set():
                self.errors.append(_disk_error(e, f.path) if isinstance(e, OSError) else e)
                self.request_stop()
        finally:
            self.active.pop(f.path, None)

    async def _blocking(self, fn, *args):
        fut = self.loop.run_in_executor(self.pool, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])  # never close a file while a thread still reads or writes it
            raise

    def _matches(self, f: RepoFile) -> bool:
        hasher = self._hash_prefix(self.dest / f.path, f, f.size)
        return hasher is None or hasher.hexdigest() == _expected_digest(f)

    def _hash_prefix(self, path: Path, f: RepoFile, length: int):
        hasher, read = _hasher(f), 0
        if hasher is None:
            return None
        with open(path, "rb", buffering=0) as fh:
            while read < length:
                if self.stop.is_set():
                    raise _Stop()
                chunk = fh.read(min(self.chunk_bytes, length - read))
                if not chunk:
                    raise OSError(errno.EIO, f"{path} shrank while being read")
                hasher.update(chunk)
                read += len(chunk)
        return hasher

    def _open_partial(self, f: RepoFile):
        """Return (offset, hasher fed with the partial so far, fd positioned at offset)."""
        part, offset = _part_path(self.dest, f), _usable_partial(self.dest, f, self.ledger)
        part.parent.mkdir(parents=True, exist_ok=True)
        if offset == 0:
            self.ledger.update(f.path, partial=_identity(f))  # before the partial exists
        hasher = self._hash_prefix(part, f, offset) if offset else _hasher(f)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(fd, offset)
        os.lseek(fd, offset, os.SEEK_SET)
        self.done[f.path] = offset
        return offset, hasher, fd

    def _finish(self, f: RepoFile, hasher) -> None:
        if hasher is not None and hasher.hexdigest() != _expected_digest(f):
            self._discard(f)
            raise HubError(f"{f.path} arrived corrupted (checksum mismatch); it will be fetched again.",
                           False, "corrupt")
        final = self.dest / f.path
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(_part_path(self.dest, f), final)
        diskwrite.fsync_dir(final.parent)
        self.ledger.update(f.path, verified=_identity(f))

    def _discard(self, f: RepoFile) -> None:
        _part_path(self.dest, f).unlink(missing_ok=True)
        self.ledger.update(f.path)
        self.done[f.path] = 0

    def _write_block(self, f: RepoFile, fd: int, hasher, block: list[bytes]) -> None:
        size = sum(map(len, block))
        if hasher is not None:
            for piece in block:
                hasher.update(piece)
        diskwrite.write_all(fd, block)
        diskwrite.start_writeback(fd, self.done[f.path], size)
        self.done[f.path] += size
        self.fetched[f.path] += size

    async def _stream(self, f: RepoFile, fd: int, offset: int, hasher):
        """GET the rest of a file into fd from offset; return the hasher fed with all of it."""
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        url = file_url(self.endpoint, self.info.repo_id, self.info.commit, f.path)
        received, block_start, block, pending = offset, offset, [], None
        try:
            async with self.session.get(url, headers=headers) as r:
                if r.status == 200 and offset:
                    received = block_start = 0  # the server ignored Range: start over
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                    hasher, self.done[f.path] = _hasher(f), 0
                elif r.status == 206 and not r.headers.get("Content-Range", "").startswith(f"bytes {offset}-"):
                    await self._blocking(self._discard, f)
                    raise HubError(f"The server sent the wrong range of {f.path}.", False, "unavailable")
                elif r.status == 416:  # the server's copy is shorter than the partial
                    await self._blocking(self._discard, f)
                    raise HubError(f"{f.path} is smaller than the Hub says; it will be fetched again.",
                                   False, "corrupt")
                elif r.status not in (200, 206):
                    raise self._response_error(r, f)
                try:
                    while chunk := await r.content.readany():
                        block.append(chunk)
                        received += len(chunk)
                        if received - block_start >= self.chunk_bytes:
                            pending = await self._hand_over(f, fd, hasher, block, received, pending)
                            block, block_start = [], received
                except (aiohttp.ClientError, TimeoutError):
                    if block:  # keep what arrived before the break, so a resume needn't fetch it again
                        pending = await self._hand_over(f, fd, hasher, block, received, pending)
                        await asyncio.shield(pending)
                    raise
                if block:
                    pending = await self._hand_over(f, fd, hasher, block, received, pending)
                if pending is not None:
                    await asyncio.shield(pending)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise HubError(f"The connection broke while fetching {f.path} ({type(e).__name__}); "
                           "the partial file is kept for a resume.", False, "unavailable") from e
        finally:
            if pending is not None and not pending.done():
                await asyncio.wait([pending])  # the fd is closed right after
        if received != f.size:
            raise HubError(f"The server sent {received} of {f.size} bytes of {f.path}; "
                           "the partial file is kept for a resume.", False, "unavailable")
        return hasher

    async def _hand_over(self, f: RepoFile, fd: int, hasher, block: list[bytes], received: int, pending):
        """Queue a block for hashing and writing; one in flight per file keeps them in order."""
        if pending is not None:
            await asyncio.shield(pending)
        if received > f.size:
            await self._blocking(self._discard, f)
            raise HubError(f"{f.path} is larger than the Hub says; it will be fetched again.", False, "corrupt")
        if self.stop.is_set():
            raise _Stop()
        return asyncio.ensure_future(self.loop.run_in_executor(self.pool, self._write_block, f, fd, hasher, block))

    def _response_error(self, r: aiohttp.ClientResponse, f: RepoFile) -> HubError:
        code = r.headers.get("X-Error-Code")
        if code == "RevisionNotFound":
            return HubError(f"Commit {self.info.commit} no longer exists in '{self.info.repo_id}'.", True,
                            "revision_not_found")
        if code == "RepoNotFound":
            return HubError(f"Model '{self.info.repo_id}' was not found on {self.endpoint}.", True, "not_found")
        if r.status in (401, 403, 404) and r.url.host != urlsplit(self.endpoint).hostname:
            # An expired or refused CDN link: asking the Hub again gives a fresh one.
            return HubError(f"The download link for {f.path} was refused (HTTP {r.status}); retry.",
                            False, "unavailable")
        error = status_error(r.status, self.info.repo_id, self.token, self.endpoint, f.path)
        with contextlib.suppress(KeyError, ValueError):  # seconds only; an HTTP date is rare enough to back off instead
            error.retry_after = min(float(r.headers["Retry-After"]), MAX_RETRY_AFTER_S)
        return error


def download(info: RepoInfo, dest: Path, token: str | None = None, endpoint: str | None = None,
             on_progress: Callable[[Progress], None] | None = None,
             should_cancel: Callable[[], bool] | None = None,
             chunk_bytes: int = CHUNK_BYTES, workers: int = WORKERS, verify: bool = False) -> None:
    """Fetch every file of info into dest, resuming and verifying; callbacks run on the caller's thread."""
    dest = Path(dest)
    try:
        (dest / PARTIAL_DIR).mkdir(parents=True, exist_ok=True)
        lock = open(dest / PARTIAL_DIR / ".lock", "a")
    except OSError as e:
        raise _disk_error(e, str(dest)) from e
    with lock:
        try:
            # The kernel drops this lock when the process dies, so a killed worker never blocks a resume.
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise HubError(f"Another download into {dest} is running.", False, "busy") from None
        _Download(info, dest, token, endpoint_url(endpoint), chunk_bytes, max(1, workers)).run(
            verify, on_progress, should_cancel)
    # Every file is complete and verified: the partials' folder has nothing left to resume (a later
    # download of the same copy hashes the complete files again instead of trusting the ledger).
    shutil.rmtree(dest / PARTIAL_DIR, ignore_errors=True)
