"""The node gateway: the one public door to a node's engines, an asyncio proxy of the panel's own.

Why our own and not nginx or vllm-router: it must check caller keys against a set that changes within a second
on every node, apply per-key limits and per-deployment admission, follow names across a swap by waiting for a
ready deployment, and read each stream's usage for the Usage table — all of it per request, without a round
trip to the panel. Everything a request needs is in memory (config.Snapshot, limits); the database is read
only by the reload and usage loops, in one thread of their own.

Only the OpenAI routes pass (FORWARDED); every other path, vLLM's admin, dev and weight endpoints included,
is 404 here. Engines are reached on 127.0.0.1 with their engine key; a deployment on another node through that
node's gateway with the key of that pair of nodes and hour (peers.py; over TLS when GATEWAY_TLS_CERT is set): the
receiving gateway serves such a request from the pinned deployment only, and does not count it again.
"""
import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pydantic
from aiohttp import web

from deployments.gateway import config, keyset, media, peers, stream, upstream, usage
from deployments.gateway.keyset import Refused
from deployments.gateway.limits import Admission, KeyLimits, retry_after_header
from deployments.gateway.reload import Watcher
from deployments.host import vllm

log = logging.getLogger(__name__)

FORWARDED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"})
CUT_TOKENS = web.RequestKey("cut_tokens", usage.Tokens)  # on the request: what a stream the caller cut had used
STREAMS_USAGE = frozenset({"/v1/chat/completions", "/v1/completions"})  # accept stream_options.include_usage
PIN = "X-Panel-Deployment"  # gateway to gateway: the deployment the origin chose (peer gateways only)
DOWN_S = 1.0  # an engine that refused a connection is skipped this long (or until the next reload)
CONNECT_TRIES = 3
MAX_BODY = 64 << 20  # data: images and audio travel in the body
ADMISSION_RETRY_S = 1.0  # an engine that refused for load: its queue drains within a request or two


class EngineDown(Exception):
    """The engine refused or dropped the connection before anything was sent to the caller."""


def error(refusal: Refused) -> web.Response:
    headers = {}
    if refusal.retry_after is not None:
        headers["Retry-After"] = retry_after_header(refusal.retry_after)
        headers["retry-after-ms"] = str(max(1, int(refusal.retry_after * 1000)))  # the OpenAI clients read it first
    return web.json_response(refusal.body(), status=refusal.status, headers=headers)


def not_found(request) -> web.Response:
    return error(Refused(404, "not_found", f"{request.method} {request.path} is not served by this gateway."))


class Gateway:
    """State shared by every request: the snapshot, limits, admission queues, usage counters, one client."""

    def __init__(self, node: str, ready_wait_s: float = 30.0, flush_s: float = 2.0, poll_s: float = 0.25):
        self.node, self.ready_wait_s, self.flush_s = node, ready_wait_s, flush_s
        self.snapshot = config.Snapshot()
        self.keys: dict[int, KeyLimits] = {}
        self.admissions: dict[int, Admission] = {}
        self.waiting: dict[str, int] = {}  # model name -> requests waiting for a ready deployment
        self.down: dict[int, float] = {}
        self.meter = usage.Meter()
        self.db_pool = ThreadPoolExecutor(1, thread_name_prefix="gateway-db")
        self.changed = asyncio.Event()
        self.watcher = Watcher(self, poll_s)
        self.session: aiohttp.ClientSession | None = None  # answers read whole, engine metrics
        self.pool = upstream.Pool()  # streams
        self.tls = peers.client_context()  # how the other nodes' gateways are checked (None: plain HTTP)
        self.port = None

    async def db(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.db_pool, fn, *args)

    def install(self, snapshot: config.Snapshot) -> None:
        """Serve from `snapshot` from now on, and wake the requests waiting for a ready deployment."""
        self.snapshot = snapshot
        self.down.clear()
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def revoke(self, digests) -> None:
        """Refuse these keys from now on, without waiting for the next snapshot."""
        keys = self.snapshot.keys
        for key_digest in digests:
            key = keys.get(key_digest)
            if key is not None:
                keys[key_digest] = key._replace(revoked=True)

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30),
            timeout=aiohttp.ClientTimeout(total=None, connect=10), read_bufsize=1 << 20, auto_decompress=False)
        self.watcher.version = await self.watcher._version()
        await self.watcher.reload()
        self.watcher.start()
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def close(self) -> None:
        self.watcher.stop()
        self._flusher.cancel()
        await self.flush()
        if self.session is not None:
            await self.session.close()
        self.pool.close()
        self.db_pool.shutdown(wait=True)

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        counts, used = self.meter.take()
        if not counts:
            return
        try:
            await self.db(usage.flush, counts, used)
        except Exception as exc:  # noqa: BLE001 - the database may be away: keep counting, try again
            log.warning("Could not write usage (kept for the next flush): %s", exc)
            self.meter.put_back(counts, used)

    # Requests

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if path in FORWARDED and request.method == "POST":
            return await self.proxy(request)
        if path == "/v1/models" and request.method == "GET":
            return self.models(request)
        if path == "/healthz":
            return web.json_response({"status": "ok", "node": self.node, "keys": len(self.snapshot.keys),
                                      "deployments": len(self.snapshot.targets)})
        if path.startswith("/engines/") and path.endswith("/metrics") and request.method == "GET":
            return await self.metrics(request, path[len("/engines/"):-len("/metrics")])
        return not_found(request)

    def authenticate(self, request, metrics: bool = False) -> config.Key:
        return keyset.authenticate(self.snapshot, request.headers.get("Authorization", ""), metrics=metrics,
                                   remote=request.remote, peer=request.headers.get(peers.HEADER), node=self.node)

    def models(self, request) -> web.Response:
        try:
            key = self.authenticate(request)
        except Refused as refusal:
            return error(refusal)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "vllm-control-panel"}
                for name in keyset.names_for(self.snapshot, key)]
        return web.json_response({"object": "list", "data": data})

    async def metrics(self, request, deployment_id: str) -> web.Response:
        """An engine's own /metrics for Prometheus: the scrape token only, engines of this node only."""
        try:
            self.authenticate(request, metrics=True)
        except Refused as refusal:
            return error(refusal)
        target = self.snapshot.targets.get(int(deployment_id)) if deployment_id.isdigit() else None
        if target is None or not target.local:
            return not_found(request)
        headers = {"Authorization": f"Bearer {target.bearer}"} if target.bearer else {}
        try:
            async with self.session.get(f"{target.url}/metrics", headers=headers,
                                        timeout=aiohttp.ClientTimeout(total=10)) as reply:
                body = await reply.read()
                return web.Response(body=body, status=reply.status,
                                    headers={"Content-Type": reply.headers.get("Content-Type", "text/plain")})
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return error(Refused(502, "engine_unreachable", f"{target.name}'s engine did not answer: {exc}",
                                 kind="api_error"))

    async def proxy(self, request: web.BaseRequest) -> web.StreamResponse:
        snapshot = self.snapshot
        try:
            key = self.authenticate(request)
            body, raw = await _body(request)
        except Refused as refusal:
            return error(refusal)
        name = body["model"]
        pinned = request.headers.get(PIN, "") if key.internal else ""
        try:
            ids = [int(pinned)] if pinned.isdigit() else keyset.scope_check(snapshot, key, name)
        except Refused as refusal:
            self._count(key, name if refusal.status == 403 else usage.UNKNOWN_MODEL, None, True)
            return error(refusal)
        limits = self.keys.get(key.id)
        if limits is None:
            limits = self.keys[key.id] = KeyLimits()
        try:
            limits.admit(key)
        except Refused as refusal:
            self._count(key, name, None, True, refused=refusal.status == 429)
            return error(refusal)
        tokens, failed, target, refused = None, True, None, False
        try:
            for _ in range(CONNECT_TRIES):
                target = await self.route(key, name, ids, pinned)
                admission = self.admissions[target.id]
                try:
                    response, tokens, failed = await self.forward(request, target, body, raw)
                    refused = response.status == 429  # the engine's admission cap, answered as the gateway's
                    return response
                except asyncio.CancelledError:  # the caller went away mid-stream: what it got is counted
                    tokens = request.get(CUT_TOKENS)
                    raise
                except EngineDown as exc:
                    log.warning("%s refused a connection (%s): trying again", target.name, exc)
                    self.down[target.id] = time.monotonic() + DOWN_S
                finally:
                    admission.release(target.max_in_flight)
            raise Refused(503, "engine_unavailable", f"No engine serving '{name}' accepted the request.",
                          retry_after=1.0, kind="api_error")
        except Refused as refusal:
            refused = refusal.status == 429  # the deployment's queue bound
            return error(refusal)
        finally:
            limits.done(tokens.total if tokens else 0)
            self._count(key, name, target.id if target else None, failed, tokens, refused)

    def _count(self, key, name, deployment_id, failed, tokens=None, refused=False) -> None:
        if not key.internal:  # a request from another gateway: its origin counts it
            self.meter.count(key.id, name, deployment_id, failed, tokens, refused)

    async def route(self, key, name: str, ids: list[int], pinned: str) -> config.Target:
        """A ready deployment for `name`, its admission slot taken; waits up to ready_wait_s for one to be ready
        (a swap, a restart), then Refused(503)."""
        deadline = time.monotonic() + self.ready_wait_s
        waiting = False
        try:
            while True:
                snapshot, now = self.snapshot, time.monotonic()
                ready = [t for i in ids if (t := snapshot.targets.get(i)) is not None and t.ready
                         and self.down.get(i, 0.0) <= now]
                if ready:
                    target = min(ready, key=lambda t: (self._admission(t.id).load / t.max_in_flight, not t.local))
                    await self._admission(target.id).acquire(target.max_in_flight, target.queue_bound, target.name)
                    return target
                if not waiting:
                    bound = sum(t.queue_bound for i in ids if (t := snapshot.targets.get(i))) or 256
                    if self.waiting.get(name, 0) >= bound:
                        raise Refused(503, "model_unavailable", f"'{name}' has no ready deployment and {bound} "
                                      "requests waiting for one.", retry_after=5.0, kind="api_error")
                    self.waiting[name] = self.waiting.get(name, 0) + 1
                    waiting = True
                left = deadline - now
                if left <= 0:
                    raise Refused(503, "model_unavailable", f"No deployment serving '{name}' is ready yet.",
                                  retry_after=5.0, kind="api_error")
                try:
                    await asyncio.wait_for(self.changed.wait(), min(left, DOWN_S))
                except asyncio.TimeoutError:
                    pass
                if not pinned:
                    try:
                        ids = keyset.scope_check(self.snapshot, key, name)
                    except Refused:
                        pass  # nothing serves the name for a moment (one stopped, the next not made yet): wait on
        finally:
            if waiting:
                self.waiting[name] -= 1

    def _admission(self, deployment_id: int) -> Admission:
        admission = self.admissions.get(deployment_id)
        if admission is None:
            admission = self.admissions[deployment_id] = Admission()
        return admission

    async def forward(self, request, target: config.Target, body: dict, raw: bytes):
        """(response, tokens, failed) from `target`; EngineDown when it could not be reached."""
        found = media.urls(body)
        blocked = media.refused(found, target.media_domains) if found else None
        if blocked is not None:
            raise Refused(400, "media_url_not_allowed", f"{target.name} may not fetch {blocked[:200]}: only data: "
                          "URLs and the deployment's allowed media domains are.")
        streaming = body.get("stream") is True
        out, strip = body, False
        if streaming and request.path in STREAMS_USAGE:
            options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
            if not options.get("include_usage"):
                out, strip = {**body, "stream_options": {**options, "include_usage": True}}, True
        if body["model"] != target.served:
            out = {**out, "model": target.served}
        headers = {"Content-Type": "application/json"}
        if not target.local:
            headers.update({"Authorization": f"Bearer {peers.current(self.node, target.node)}",
                            peers.HEADER: self.node, PIN: str(target.id)})
        elif target.bearer:
            headers["Authorization"] = f"Bearer {target.bearer}"
        data = raw if out is body else json.dumps(out).encode()
        if streaming:
            return await self._stream(request, target, headers, data, strip, body)
        try:
            reply = await self.session.post(target.url + request.path, data=data, headers=headers,
                                            ssl=(self.tls if not target.local and self.tls else True))
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
            raise EngineDown(str(exc)) from exc
        async with reply:
            kind = reply.headers.get("Content-Type", "application/json")
            try:
                answer = await reply.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise Refused(502, "engine_error", f"{target.name}'s engine broke off its answer: {exc}",
                              kind="api_error") from exc
            return _answer(answer, reply.status, kind)

    async def _stream(self, request, target: config.Target, headers: dict, data: bytes, strip: bool, body: dict):
        """A streamed answer through upstream.py's direct relay (the caller's socket written from the engine's)."""
        host, port = target.address
        loop = asyncio.get_running_loop()
        for _ in range(2):
            try:
                conn, reused = await self.pool.connect(host, port, tls=None if target.local else self.tls)
            except (OSError, asyncio.TimeoutError) as exc:
                raise EngineDown(str(exc)) from exc
            sink = upstream.Sink(loop, strip, framed=request.version >= aiohttp.HttpVersion11)
            conn.send(upstream.request_bytes(host, port, request.path, headers, data), sink)
            try:
                status, head = await sink.head
                break
            except upstream.Broken as exc:
                if not reused:  # a kept connection the engine had closed: once more on a new one
                    raise EngineDown(str(exc)) from exc
            except asyncio.CancelledError:
                sink.finish(upstream.Broken("the caller went away"))
                raise
        kind = head.get("content-type", "application/json")
        if status != 200 or not kind.startswith("text/event-stream"):
            broken = await sink.done
            if broken is not None:
                raise Refused(502, "engine_error", f"{target.name}'s engine broke off its answer: {broken}",
                              kind="api_error")
            return _answer(b"".join(sink.held), status, kind)
        try:  # the caller's head waits for the first event: the engine's admission can still refuse in it
            await sink.first
        except asyncio.CancelledError:
            sink.finish(upstream.Broken("the caller went away"))
            raise
        if (refused := stream.refusal(b"".join(sink.held))) is not None:
            await sink.done  # its [DONE] follows at once
            return _answer(json.dumps(refused).encode(), refused["error"]["code"], "application/json")
        response = web.StreamResponse(headers={"Content-Type": kind, "Cache-Control": "no-cache"})
        await response.prepare(request)
        sink.attach(request.transport)
        try:
            broken = await sink.done
        except asyncio.CancelledError:  # the caller went away: so does the engine's request
            sink.finish(upstream.Broken("the caller went away"))
            request[CUT_TOKENS] = _used(sink, body)
            raise
        rest = sink.rest()
        transport = request.transport
        if broken is not None or transport is None or transport.is_closing():
            log.info("A stream from %s ended early: %s", target.name, broken or "the caller went away")
            return response, _used(sink, body), True
        if rest:
            await response.write(rest)
        await response.write_eof()
        return response, sink.relay.tokens, False


def _used(sink: upstream.Sink, body: dict) -> usage.Tokens:
    """What a stream that ended early used: its usage event when one came, else what was forwarded of it."""
    return sink.relay.tokens or usage.streamed(body, sink.relay.events)


def _answer(answer: bytes, status: int, kind: str):
    """(response, tokens, failed) for an answer read whole. An engine's admission refusal (vLLM's 503 once its
    --max-num-queued-reqs or --max-num-queued-tokens is reached) goes to the caller as the gateway's own: 429 with
    Retry-After, which clients back off on (a 503 reads as "down")."""
    tokens, headers = None, {"Content-Type": kind}
    if status == 200:
        try:
            tokens = usage.tokens_of(json.loads(answer).get("usage"))
        except (ValueError, AttributeError):
            pass
    elif status == 503 and vllm.refused_for_load(status, vllm.openai_error(answer.decode("utf-8", "replace")) or ""):
        status, headers["Retry-After"] = 429, retry_after_header(ADMISSION_RETRY_S)
    return web.Response(body=answer, status=status, headers=headers), tokens, status >= 400


async def _body(request) -> tuple[dict, bytes]:
    """The JSON body with a string "model" and its bytes (forwarded as they are when nothing changes), or
    Refused(400). `stream` and `stream_options.include_usage` are read as the engine reads them (pydantic's lax
    booleans: "true", 1, "on"...) and forwarded as JSON booleans, so what the gateway meters is what the engine
    does: a "stream": "true" read here as not streaming was streamed by vLLM and counted as 0 tokens."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError:
        raise Refused(400, "invalid_json", "The request body is not JSON.") from None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        raise Refused(400, "model_required", "The request body must be a JSON object naming a \"model\".")
    options = body.get("stream_options")
    lax = "stream" in body and not isinstance(body["stream"], bool)
    lax_usage = isinstance(options, dict) and "include_usage" in options and not isinstance(options["include_usage"], bool)
    if lax or lax_usage:
        body = {**body, "stream": _lax_bool(body.get("stream"), "stream")}
        if lax_usage:
            body["stream_options"] = {**options, "include_usage": _lax_bool(options["include_usage"],
                                                                           "stream_options.include_usage")}
        raw = json.dumps(body).encode()
    return body, raw


LAX_BOOL = pydantic.TypeAdapter(bool)  # vLLM's request models are pydantic's, in its lax mode


def _lax_bool(value, field: str) -> bool:
    """A boolean as vLLM reads it ("true", 1, "on"... null is "not given"), or Refused(400) where vLLM refuses."""
    if value is None:
        return False
    try:
        return LAX_BOOL.validate_python(value)
    except pydantic.ValidationError:
        raise Refused(400, "invalid_request", f'"{field}" must be true or false.') from None


async def serve(gateway: Gateway, host: str, port: int) -> web.ServerRunner:
    """Bind `host:port` and start serving; Node.gateway_port says the port once the node's row exists."""
    server = _Server(gateway.handle, handler_cancellation=True, access_log=None)
    runner = web.ServerRunner(server, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096, ssl_context=peers.server_context())
    await site.start()
    gateway.port = runner.addresses[0][1]
    await gateway.start()
    return runner


class _Server(web.Server):
    """aiohttp's low-level server (no router: handle() is the whole table) with room for multimodal bodies."""

    def _make_request(self, message, payload, protocol, writer, task):
        return web.BaseRequest(message, payload, protocol, writer, task, self._loop, client_max_size=MAX_BODY)
