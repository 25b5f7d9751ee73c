"""A Hugging Face Hub-compatible test server that serves model repos from a local folder."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from aiohttp import web

LFS_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx", ".pkl"}
LFS_MIN_SIZE = 10 * 1024 * 1024
HIDDEN = {".gated"}  # control files of the test server, never part of a repo
CDN_HOST = "127.0.0.2"  # another host than 127.0.0.1, so redirects there are cross-origin


@dataclass(frozen=True)
class Entry:
    """One file of a repo as the Hub describes it."""

    path: str
    size: int
    sha256: str
    blob_id: str
    lfs: bool
    pointer_size: int


@dataclass
class Repo:
    """A repo folder at its single commit."""

    repo_id: str
    root: Path
    commit: str
    entries: dict[str, Entry]
    token: str | None  # None: public; else the only Bearer token that may read it


@dataclass
class State:
    """What the server knows and counts; control endpoints change it at run time."""

    root: Path
    repos: dict[str, Repo] = field(default_factory=dict)
    throttle_bps: int | None = None
    fail_status: int | None = None
    drop_after: int | None = None  # close the connection after this many body bytes
    ignore_range: bool = False  # answer Range requests with the whole file, like some proxies
    cdn: bool = True
    cdn_base: str | None = None
    # One-shot faults, each taken by the first file request that reaches its point, in order (FAULT_KINDS).
    faults: list[dict] = field(default_factory=list)
    faults_served: list[str] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)
    requests: list[dict] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _git_blob_sha1(data_len: int, chunks) -> str:
    h = hashlib.sha1(b"blob %d\0" % data_len)
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def _read_chunks(path: Path, size: int = 8 << 20):
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


LFS_POINTER = b"version https://git-lfs.github.com/spec/v1\n"


def _scan_entry(repo_root: Path, path: Path) -> Entry:
    rel = path.relative_to(repo_root).as_posix()
    size = path.stat().st_size
    if size < 1024 and (pointer := path.read_bytes()).startswith(LFS_POINTER):
        # A Git LFS pointer (a clone without git-lfs): described as the Hub describes the file it stands for,
        # so a repo can list a 40 GiB shard without one on disk. Its bytes cannot be served (metadata tests only).
        fields = dict(line.split(" ", 1) for line in pointer.decode().splitlines() if " " in line)
        return Entry(rel, int(fields["size"]), fields["oid"].removeprefix("sha256:"),
                     _git_blob_sha1(len(pointer), [pointer]), True, len(pointer))
    sha = hashlib.sha256()
    blob = hashlib.sha1(b"blob %d\0" % size)
    for chunk in _read_chunks(path):
        sha.update(chunk)
        blob.update(chunk)
    lfs = path.suffix in LFS_SUFFIXES or size >= LFS_MIN_SIZE
    if not lfs:
        return Entry(rel, size, sha.hexdigest(), blob.hexdigest(), False, 0)
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha.hexdigest()}\nsize {size}\n".encode()
    return Entry(rel, size, sha.hexdigest(), _git_blob_sha1(len(pointer), [pointer]), True, len(pointer))


def load_repo(state: State, repo_id: str) -> Repo | None:
    """Scan a repo folder once (hashes are cached until the server stops)."""
    with state.lock:
        if repo_id in state.repos:
            return state.repos[repo_id]
    root = state.root / repo_id
    if repo_id.count("/") != 1 or ".." in repo_id or not root.is_dir():
        return None
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name not in HIDDEN)
    entries = {e.path: e for e in (_scan_entry(root, p) for p in files)}
    listing = json.dumps([[e.path, e.sha256] for e in entries.values()]).encode()
    gated = root / ".gated"
    token = gated.read_text().strip() if gated.exists() else None
    repo = Repo(repo_id, root, hashlib.sha1(listing).hexdigest(), entries, token)
    with state.lock:
        return state.repos.setdefault(repo_id, repo)


# Where a file request meets each kind of fault: "status" {status, retry_after?} answers the Hub's resolve with an
# error (5xx, or 429 with Retry-After); "expired" answers the CDN with 403 as an expired signed link does; "reset"
# {after} closes the connection after that many bytes of the body; "stall" {after, seconds} sends nothing more for
# that long after that many bytes, then closes. With "path", a fault waits for a request of that file.
FAULT_KINDS = {"status": "resolve", "expired": "cdn", "reset": "body", "stall": "body"}


def _take_fault(state: State, point: str, path: str) -> dict | None:
    """The next fault when it belongs at `point` (and to `path` if it names one); it is then spent."""
    with state.lock:
        head = state.faults[0] if state.faults else None
        if head and FAULT_KINDS[head["kind"]] == point and head.get("path", path) == path:
            fault = state.faults.pop(0)
            state.faults_served.append(fault["kind"])
            return fault
    return None


def _error(status: int, code: str | None, message: str, **extra: str) -> web.Response:
    headers = {"X-Error-Message": message, **extra}
    if code:
        headers["X-Error-Code"] = code
    return web.json_response({"error": message}, status=status, headers=headers)


def _repo_or_error(request: web.Request, listing: bool = False) -> Repo | web.Response:
    """The repo a request names, or the Hub's error; `listing` (model info, tree): a gated repo is listed to anyone,
    as on the real Hub, and only its files are refused without a token with access."""
    state: State = request.app[STATE]
    if state.fail_status:
        return _error(state.fail_status, None, "Injected failure")
    repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
    repo = load_repo(state, repo_id)
    if repo is None:
        return _error(404, "RepoNotFound", "Repository not found")
    if repo.token is not None and not listing:
        auth = request.headers.get("Authorization", "")
        if not auth:
            return _error(401, "GatedRepo", "Access to this model is restricted; you must be authenticated")
        if auth != f"Bearer {repo.token}":
            return _error(403, "GatedRepo", "Access to this model is restricted; your token has no access")
    rev = request.match_info.get("rev")
    if rev is not None and rev not in ("main", repo.commit):
        return _error(404, "RevisionNotFound", "Invalid rev id")
    return repo


def _sibling(e: Entry, blobs: bool) -> dict:
    if not blobs:
        return {"rfilename": e.path}
    out = {"rfilename": e.path, "size": e.size, "blobId": e.blob_id}
    if e.lfs:
        out["lfs"] = {"sha256": e.sha256, "size": e.size, "pointerSize": e.pointer_size}
    return out


async def model_info(request: web.Request) -> web.StreamResponse:
    repo = _repo_or_error(request, listing=True)
    if isinstance(repo, web.Response):
        return repo
    blobs = request.query.get("blobs", "").lower() in ("1", "true")
    return web.json_response({
        "_id": repo.commit[:24],
        "id": repo.repo_id,
        "modelId": repo.repo_id,
        "sha": repo.commit,
        "private": False,
        "gated": "manual" if repo.token else False,
        "disabled": False,
        "downloads": 0,
        "likes": 0,
        "tags": [],
        "lastModified": "2026-01-01T00:00:00.000Z",
        "createdAt": "2026-01-01T00:00:00.000Z",
        "siblings": [_sibling(e, blobs) for e in repo.entries.values()],
    })


async def tree(request: web.Request) -> web.StreamResponse:
    repo = _repo_or_error(request, listing=True)
    if isinstance(repo, web.Response):
        return repo
    base = request.match_info.get("path", "").strip("/")
    recursive = request.query.get("recursive", "").lower() in ("1", "true")
    prefix = f"{base}/" if base else ""
    out, dirs = [], set()
    for e in repo.entries.values():
        if not e.path.startswith(prefix):
            continue
        rest = e.path[len(prefix):].split("/")
        for depth in range(1, len(rest)):
            d = prefix + "/".join(rest[:depth])
            if d not in dirs and (recursive or depth == 1):
                dirs.add(d)
                out.append({"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d})
        if recursive or len(rest) == 1:
            item = {"type": "file", "oid": e.blob_id, "size": e.size, "path": e.path}
            if e.lfs:
                item["lfs"] = {"oid": e.sha256, "size": e.size, "pointerSize": e.pointer_size}
            out.append(item)
    if base and not out:
        return _error(404, "EntryNotFound", "Entry not found")
    return web.json_response(out)


def _file_headers(repo: Repo, e: Entry) -> dict[str, str]:
    etag = e.sha256 if e.lfs else e.blob_id
    headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
    if e.lfs:
        headers |= {"X-Linked-Etag": f'"{e.sha256}"', "X-Linked-Size": str(e.size)}
    return headers


async def resolve(request: web.Request) -> web.StreamResponse:
    repo = _repo_or_error(request)
    if isinstance(repo, web.Response):
        return repo
    state: State = request.app[STATE]
    e = repo.entries.get(request.match_info["path"])
    if e is None:
        return _error(404, "EntryNotFound", "Entry not found")
    if request.method == "GET" and (fault := _take_fault(state, "resolve", e.path)):
        after = {"Retry-After": str(fault["retry_after"])} if fault.get("retry_after") is not None else {}
        return _error(fault["status"], None, "Injected failure", **after)
    if e.lfs and state.cdn and state.cdn_base:
        # The real Hub answers LFS files with a redirect to a CDN on another host.
        location = f"{state.cdn_base}/_cdn/{repo.repo_id}/{repo.commit}/{quote(e.path)}"
        return web.Response(status=302, headers=_file_headers(repo, e) | {"Location": location})
    return await _send_file(request, repo, e, _file_headers(repo, e))


async def cdn(request: web.Request) -> web.StreamResponse:
    state: State = request.app[STATE]
    if "Authorization" in request.headers:
        # Like presigned S3 URLs: a forwarded Hub token is rejected.
        return _error(400, None, "Only one auth mechanism allowed")
    repo = load_repo(state, f"{request.match_info['org']}/{request.match_info['name']}")
    e = repo.entries.get(request.match_info["path"]) if repo else None
    if e is None or request.match_info["commit"] != repo.commit:
        return _error(404, None, "Not found")
    if request.method == "GET" and _take_fault(state, "cdn", e.path):
        return _error(403, None, "Request has expired")  # as S3 and CloudFront answer a signed URL past its expiry
    return await _send_file(request, repo, e, {"ETag": f'"{e.sha256}"', "Accept-Ranges": "bytes"})


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """Return (start, end_exclusive), None for the whole file, or 'bad'."""
    if not header:
        return None
    try:
        unit, spec = header.split("=", 1)
        first, last = spec.split("-", 1)
        if unit.strip() != "bytes" or "," in spec:
            return "bad"
        if not first:
            start, end = max(size - int(last), 0), size
        else:
            start, end = int(first), min(int(last) + 1, size) if last else size
    except ValueError:
        return "bad"
    return (start, end) if start < end else "bad"


async def _send_file(request: web.Request, repo: Repo, e: Entry, headers: dict) -> web.StreamResponse:
    state: State = request.app[STATE]
    rng = None if state.ignore_range else _parse_range(request.headers.get("Range"), e.size)
    with state.lock:
        state.requests.append({"method": request.method, "repo": repo.repo_id, "path": e.path,
                               "range": request.headers.get("Range")})
    if rng == "bad":
        return web.Response(status=416, headers={"Content-Range": f"bytes */{e.size}"})
    start, end = rng or (0, e.size)
    resp = web.StreamResponse(status=206 if rng else 200, headers=headers)
    resp.content_length = end - start
    resp.content_type = "application/octet-stream"
    if rng:
        resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{e.size}"
    await resp.prepare(request)
    if request.method == "HEAD":
        return resp
    key = f"{repo.repo_id}/{e.path}"
    fault = _take_fault(state, "body", e.path)
    with open(repo.root / e.path, "rb") as f:
        if state.throttle_bps or state.drop_after or fault:
            if not await _send_slowly(request, resp, f, start, end, key, fault):
                return resp  # dropped on purpose
        else:
            await asyncio.get_running_loop().sendfile(request.transport, f, start, end - start)
            _count(state, key, end - start)
    await resp.write_eof()
    return resp


def _count(state: State, key: str, n: int) -> None:
    with state.lock:
        state.served[key] = state.served.get(key, 0) + n


async def _send_slowly(request, resp, f, start: int, end: int, key: str, fault: dict | None = None) -> bool:
    state: State = request.app[STATE]
    f.seek(start)
    sent, began = 0, time.monotonic()
    cut = state.drop_after if fault is None else fault["after"]
    while start + sent < end:
        chunk = f.read(min(64 * 1024, end - start - sent))
        if cut is not None and sent + len(chunk) > cut:
            chunk = chunk[: max(cut - sent, 0)]
            await resp.write(chunk)
            _count(state, key, len(chunk))
            await asyncio.sleep(fault["seconds"] if fault and fault["kind"] == "stall" else 0.05)
            if request.transport is not None:  # a client that gave up on the stall has closed it already
                request.transport.close()
            return False
        await resp.write(chunk)
        sent += len(chunk)
        _count(state, key, len(chunk))
        if state.throttle_bps:
            # Against an absolute schedule, so sleeps do not add up to a slower rate.
            delay = began + sent / state.throttle_bps - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
    return True


async def stats(request: web.Request) -> web.StreamResponse:
    state: State = request.app[STATE]
    with state.lock:
        if request.method == "POST":
            state.served.clear()
            state.requests.clear()
        return web.json_response({
            "served": dict(state.served), "total": sum(state.served.values()), "requests": list(state.requests),
            "faults_served": list(state.faults_served), "faults_left": list(state.faults),
        })


async def control(request: web.Request) -> web.StreamResponse:
    state: State = request.app[STATE]
    body = await request.json()
    for key in ("throttle_bps", "fail_status", "drop_after", "ignore_range", "cdn"):
        if key in body:
            setattr(state, key, body[key])
    if "faults" in body:
        unknown = [f for f in body["faults"] if f.get("kind") not in FAULT_KINDS]
        if unknown:
            return web.json_response({"error": f"unknown fault kinds {unknown}"}, status=400)
        with state.lock:
            state.faults, state.faults_served = list(body["faults"]), []
    return web.json_response({"ok": True})


STATE = web.AppKey("state", State)


def make_app(root: Path, **options) -> web.Application:
    """Build the aiohttp app for repos under root; options set State fields."""
    app = web.Application()
    app[STATE] = State(root=Path(root), **options)
    r = app.router
    r.add_get("/_stats", stats)
    r.add_post("/_stats", stats)
    r.add_post("/_control", control)
    r.add_get("/_cdn/{org}/{name}/{commit}/{path:.+}", cdn)
    r.add_get("/api/models/{org}/{name}", model_info)
    r.add_get("/api/models/{org}/{name}/revision/{rev}", model_info)
    r.add_get("/api/models/{org}/{name}/tree/{rev}", tree)
    r.add_get("/api/models/{org}/{name}/tree/{rev}/{path:.+}", tree)
    r.add_get("/{org}/{name}/resolve/{rev}/{path:.+}", resolve)
    return app


async def _start(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        # The "CDN": the same app on another loopback address, for cross-host redirects.
        await web.TCPSite(runner, CDN_HOST, port).start()
        app[STATE].cdn_base = f"http://{CDN_HOST}:{port}"
    except OSError:
        app[STATE].cdn_base = None
    return runner, port


@contextlib.contextmanager
def serve(repos_root: Path, port: int = 0, **options):
    """Run the server in a background thread; yield its base URL."""
    app = make_app(Path(repos_root), **options)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="hfserver", daemon=True)
    thread.start()
    runner, port = asyncio.run_coroutine_threadsafe(_start(app, "127.0.0.1", port), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _post(url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.load(resp)


def get_stats(base_url: str) -> dict:
    """Bytes served per 'org/name/path', their total, and the file requests seen."""
    with urllib.request.urlopen(f"{base_url}/_stats", timeout=10) as resp:
        return json.load(resp)


def reset_stats(base_url: str) -> dict:
    """Zero the counters; return what they held."""
    return _post(f"{base_url}/_stats")


def configure(base_url: str, **options) -> None:
    """Change throttle_bps, fail_status, drop_after, ignore_range, cdn or the queue of one-shot faults
    (faults=[{"kind": ...}], see FAULT_KINDS) while the server runs."""
    _post(f"{base_url}/_control", options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True, type=Path, help="folder holding <org>/<name>/ repos")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--throttle", type=int, default=None, help="bytes per second per response")
    parser.add_argument("--no-cdn", action="store_true", help="serve LFS files without a redirect")
    args = parser.parse_args()

    async def run() -> None:
        app = make_app(args.root, throttle_bps=args.throttle, cdn=not args.no_cdn)
        _, port = await _start(app, args.host, args.port)
        print(f"serving {args.root} on http://{args.host}:{port}", flush=True)
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
