"""A punctual OpenAI-compatible SSE server whose every chunk leaves on a known schedule.

Each streamed request: a role-only chunk at once (or with the first token, like vLLM), the first
token chunk TTFT after the request's bytes arrived, then one chunk every gap carrying k tokens
(the first r tokens as `reasoning`, then `content`), the usage chunk and [DONE] right after the
last token chunk. Every chunk is written against an absolute deadline by one scheduler; /stats
reports how late the writes were and the TTFT and ITL the server actually delivered (the truth
a client's measurement is compared with). Also /v1/models, /metrics (vllm: names) and /health.

    with SchedServer(ttft_ms=50, gap_ms=10) as server: ... server.base_url ...
    taskset -c 0 python tests/schedserver.py --port 8100 --ttft-ms 50 --gap-ms 10 --tokens-per-chunk 1
"""
import argparse
import asyncio
import gc
import heapq
import itertools
import json
import random
import statistics
import threading
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pydantic
from aiohttp import web

if __package__ in (None, ""):  # run as a script (perf/ does): the repository, not tests/, must be on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.schedbodies import build_chunks, count_prompt, full_response  # noqa: E402
from tests.schedcache import PrefixCache  # noqa: E402
from tests.schedtiming import ArrivalServer, Lateness  # noqa: E402
from tests.schedvllm import VllmFace, prefix_counters  # noqa: E402
from plumbing.eventloops import new_loop, raise_fd_limit  # noqa: E402

_BOOL = pydantic.TypeAdapter(bool)
ADMITTED = web.RequestKey("admitted", float)  # on a request the engine admitted after admission_gap_ms: when

perf_counter = time.perf_counter


@dataclass
class Schedule:
    """What every streamed response looks like and when each chunk leaves."""

    ttft_ms: float = 50.0
    gap_ms: float = 10.0
    tokens_per_chunk: int = 1
    reasoning_tokens: int = 0
    default_max_tokens: int = 128
    zero_delay: bool = False  # stream every chunk as fast as the core allows (ceiling tests)
    reasoning_field: str = "reasoning"  # vLLM >= 0.32; older servers say "reasoning_content"
    spin_us: float = 1500.0  # busy-wait the last stretch: loop timers are only ~1 ms precise
    kv_capacity: int = 1024  # running requests that make kv_cache_usage_perc read 1.0
    role_with_first_token: bool = False  # like vLLM: the role chunk leaves with the first token
    # Token chunks (SSE events) per write, one gap apart: vLLM's events on a busy host reach the client
    # several to a read, with no gap between them that a client could time.
    chunks_per_write: int = 1
    # Each request's gap drawn from gap_ms * (1 ± jitter), uniformly (perf/study_verdicts.py's noise).
    jitter: float = 0.0
    seed: int = 0
    prefix_cache: bool = False  # count prefix-cache queries and hits (schedcache.py) and serve them on /metrics
    # Requests served at once (0: no limit): the rest wait, first come first served, for a slot, and their
    # schedule starts when they get one. With a fixed schedule each request holds its slot a fixed service
    # time (ttft + gap x (token chunks - 1)), so the server's capacity is slots / that time, exactly.
    slots: int = 0
    # vLLM's --max-num-queued-reqs (0: none): a completion beyond that many unfinished ones is refused at once with
    # vLLM's own 503 (vllm/exceptions.py QueueOverflowError) and counted in vllm:admission_rejections.
    max_num_queued_reqs: int = 0
    # vLLM checks its cap twice: before it answers (a 503) and as it adds the request, after rendering the prompt
    # (this long here). Requests that pass the first check together can fail the second, and a stream has answered
    # 200 by then: its only event is the 503's error, then [DONE] (seen from vLLM 0.32 on the CPU).
    admission_gap_ms: float = 0.0


ADMISSION_REFUSAL = {"error": {"message": "The engine is currently busy and cannot accept new requests. Please try "
                               "again later or on a different instance.", "type": "Service Unavailable", "param": None,
                               "code": 503}}  # vLLM 0.32's body (entrypoints/serve/exception_handling/error_response.py)


class _Stream:
    """One response in flight: its transport, its framed chunks and which one is next."""

    __slots__ = ("transport", "frames", "sizes", "next", "anchor", "last", "first", "done", "gap")

    def __init__(self, transport, frames, sizes, anchor, gap=0.0):
        self.transport, self.frames, self.sizes, self.anchor = transport, frames, sizes, anchor
        self.next, self.last, self.first, self.gap = 0, 0.0, 0.0, gap
        self.done = asyncio.get_running_loop().create_future()


class Server:
    """The aiohttp application plus one scheduler task that writes every due chunk."""

    def __init__(self, schedule: Schedule, face: VllmFace | None = None):
        self.schedule = schedule
        self.face = face  # as the fake vLLM's HTTP side: vLLM's key check, names and routes (tests/schedvllm.py)
        # Two queues kept in deadline order without a heap: first chunks (anchor + TTFT, anchors
        # only grow) and next chunks (each write schedules its stream one gap later, in order).
        self.firsts: deque = deque()
        # With jitter each stream has its own gap: next chunks are kept in a heap instead.
        self.nexts = [] if schedule.jitter else deque()
        self._rng = random.Random(schedule.seed)
        self._seq = itertools.count()
        self.lateness = Lateness()
        self.truth_ttft: list[float] = []  # first-token write minus request read, as it happened
        self.truth_itl: list[float] = []  # gaps between a stream's writes, as they happened
        # (TTFT, E2E) of each finished stream from its arrival, and how long it held its slot (the service time)
        self.truth_requests: list[tuple[float, float, float]] = []
        self._slots = None
        self.running = 0
        self.unfinished = 0  # admitted completions not yet answered (the admission cap counts these)
        self.admission_rejections = 0
        self.requests_total = 0
        self.generation_tokens_total = 0
        self.prompt_tokens_total = 0
        self.prompt_log: list[int] = []  # each request's prompt tokens as this server counted them, in arrival order
        self.running_answered: list[int] = []  # num_requests_running as each /metrics answer told it, in order
        self.prefix = PrefixCache()
        self._wake = None
        self._wake_at = 0.0
        self._built: dict = {}
        self._task = None

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        """The whole routing table: a low-level server has no router."""
        if self.face is not None and (refused := self.face.refused(request)) is not None:
            return refused
        route = self._routes.get((request.method, request.path))
        if route is None:
            return web.json_response({"error": {"message": f"no route {request.method} {request.path}"}}, status=404)
        cap = self.schedule.max_num_queued_reqs
        if not cap or route != self.completions:
            return await route(request)
        if self.unfinished + 1 > cap:  # as vLLM's admission: current unfinished + n > max_num_queued_reqs
            self.admission_rejections += 1
            return web.json_response(ADMISSION_REFUSAL, status=503)
        if self.schedule.admission_gap_ms:
            await asyncio.sleep(self.schedule.admission_gap_ms / 1000)
            if self.unfinished + 1 > cap:  # the second check: a stream has its 200 already
                self.admission_rejections += 1
                try:
                    streams = _BOOL.validate_python(json.loads(await request.read()).get("stream") or False)
                except (ValueError, AttributeError, pydantic.ValidationError):
                    streams = False
                if streams:
                    event = b"data: " + json.dumps(ADMISSION_REFUSAL).encode() + b"\n\ndata: [DONE]\n\n"
                    return web.Response(body=event, content_type="text/event-stream")
                return web.json_response(ADMISSION_REFUSAL, status=503)
            request[ADMITTED] = perf_counter()  # its schedule starts once the engine has it
        self.unfinished += 1
        try:
            return await route(request)
        finally:
            self.unfinished -= 1

    @property
    def _routes(self) -> dict:
        return {("POST", "/v1/chat/completions"): self.completions, ("POST", "/v1/completions"): self.completions,
                ("GET", "/v1/models"): self.models, ("GET", "/metrics"): self.metrics,
                ("GET", "/stats"): self.stats, ("GET", "/health"): self.health,
                **(self.face.routes() if self.face else {})}

    def start(self):
        self._task = asyncio.get_running_loop().create_task(self._scheduler())

    async def stop(self):
        """Stop scheduling; every stream still waiting ends where it is."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for queue in (self.firsts, self.nexts):
            while queue:
                _resolve((queue.popleft() if isinstance(queue, deque) else queue.pop())[-1].done)

    async def health(self, request):
        return web.Response(status=503 if self.face and self.face.dead else 200, text="")

    async def models(self, request):
        model = self.face.model() if self.face else {"id": "sched", "object": "model", "owned_by": "schedserver",
                                                     "max_model_len": 1 << 20}
        return web.json_response({"object": "list", "data": [model]})

    async def metrics(self, request):
        label = f'{{model_name="{self.face.name if self.face else "sched"}"}}'
        kv = min(1.0, self.running / max(1, self.schedule.kv_capacity))
        self.running_answered.append(self.running)
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {float(self.running)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} 0.0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {kv}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {float(self.generation_tokens_total)}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{label} {float(self.prompt_tokens_total)}",
            "# TYPE vllm:admission_rejections_total counter",
            f'vllm:admission_rejections_total{label[:-1]},reason="max_num_queued_reqs"}} {float(self.admission_rejections)}',
        ] + (self.prefix.metrics(label) if self.schedule.prefix_cache else prefix_counters(label) if self.face else [])
        lines += self.face.metrics(label, self.requests_total) if self.face else []
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def stats(self, request):
        """How punctual the server was: chunk lateness versus the schedule (?reset=1 starts over)."""
        late = self.lateness
        ttft, itl = sorted(self.truth_ttft) or [0.0], sorted(self.truth_itl) or [0.0]
        body = {
            "requests": self.requests_total,
            "chunks": sum(late.counts),
            "late_p50_us": late.quantile_us(0.5),
            "late_p99_us": late.quantile_us(0.99),
            "late_max_us": late.max_us,
            "ttft_median_ms": statistics.median(ttft) * 1000,
            "ttft_p90_ms": ttft[int(0.9 * (len(ttft) - 1))] * 1000,
            "itl_median_ms": statistics.median(itl) * 1000,
            "itl_p90_ms": itl[int(0.9 * (len(itl) - 1))] * 1000,
        }
        if request.query.get("truth"):  # every finished stream's [TTFT ms, E2E ms, slot held ms], in the order they ended
            body["truth"] = [[round(x * 1000, 4) for x in each] for each in self.truth_requests]
        if request.query.get("reset"):
            late.reset()
            self.requests_total = 0
            self.truth_ttft, self.truth_itl, self.truth_requests = [], [], []
            gc.collect()  # the CLI server runs without automatic GC: collect between levels
        return web.json_response(body)

    async def completions(self, request):
        # The schedule starts when the request's bytes reached this process (or the engine admitted it, after
        # admission_gap_ms), not when the handler ran.
        anchor = request.get(ADMITTED) or getattr(request.protocol, "arrived", 0.0) or perf_counter()
        try:
            body = json.loads(await request.read())
        except ValueError:
            return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
        chat = request.path.endswith("/chat/completions")
        if chat and not isinstance(body.get("messages"), list):
            return web.json_response({"error": {"message": "messages must be a list"}}, status=400)
        if not chat and "prompt" not in body:
            return web.json_response({"error": {"message": "prompt is required"}}, status=400)
        try:  # booleans as vLLM's pydantic request models read them: "stream": "true" streams, "false" does not
            stream = _BOOL.validate_python(body.get("stream") or False)
            options = body.get("stream_options") or {}
            usage_flags = [_BOOL.validate_python(options.get(k) or False) for k in ("include_usage", "continuous_usage_stats")]
        except pydantic.ValidationError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        sch = self.schedule
        n = max(1, int(body.get("max_tokens") or body.get("max_completion_tokens") or sch.default_max_tokens))
        prompt_tokens = count_prompt(body)
        self.requests_total += 1
        self.prompt_tokens_total += prompt_tokens
        self.prompt_log.append(prompt_tokens)
        if sch.prefix_cache:
            self.prefix.query(body)
        reasoning = min(sch.reasoning_tokens, n) if chat else 0
        model = body.get("model", "sched")
        if not stream:
            if not sch.zero_delay:
                await asyncio.sleep((sch.ttft_ms + sch.gap_ms * (-(-n // max(1, sch.tokens_per_chunk)) - 1)) / 1000)
            self.generation_tokens_total += n
            return web.json_response(full_response(model, chat, n, reasoning, prompt_tokens))
        key = (model, chat, n, reasoning, prompt_tokens, *usage_flags)
        built = self._built.get(key)
        if built is None:  # identical requests share their chunks (and their id): building costs ~40 µs
            if len(self._built) > 1024:
                self._built.clear()
            built = self._built[key] = build_chunks(*key, sch)
        first, frames, sizes = built
        if sch.chunks_per_write > 1:
            w = sch.chunks_per_write
            frames = [b"".join(frames[i:i + w]) for i in range(0, len(frames), w)]
            sizes = [sum(sizes[i:i + w]) for i in range(0, len(sizes), w)]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)  # a StreamResponse sends its headers right away
        if first:
            await response.write(first)  # the role-only chunk
        if sch.slots and self._slots is None:
            self._slots = asyncio.Semaphore(sch.slots)
        if self._slots is not None:
            await self._slots.acquire()
        acquired = perf_counter()
        self.running += 1
        transport = request.transport
        try:
            if sch.zero_delay:
                await self._blast(transport, frames, sizes)
            else:
                gap = sch.gap_ms / 1000 * (1 + self._rng.uniform(-sch.jitter, sch.jitter))
                stream = _Stream(transport, frames, sizes, anchor, gap)
                # With slots the schedule starts when the slot was taken (now): slots are taken one after
                # another on this loop, so the deadlines in this queue still only grow.
                first_at = (perf_counter() if self._slots is not None else anchor) + sch.ttft_ms / 1000
                self.firsts.append((first_at, stream))
                self._poke(first_at)
                await stream.done
                if stream.next == len(frames):
                    self.truth_requests.append((stream.first - anchor, stream.last - anchor, perf_counter() - acquired))
        finally:
            self.running -= 1
            if self._slots is not None:
                self._slots.release()
        if transport is not None and not transport.is_closing():
            await response.write_eof()
        return response

    async def _blast(self, transport, frames, sizes):
        """Zero-delay mode: many framed chunks per write, yielding now and then."""
        batch = 64
        for i in range(0, len(frames), batch):
            if transport is None or transport.is_closing():
                return
            transport.write(b"".join(frames[i:i + batch]))
            self.generation_tokens_total += sum(sizes[i:i + batch])
            while transport.get_write_buffer_size() > 1 << 20 and not transport.is_closing():
                await asyncio.sleep(0.001)
            await asyncio.sleep(0)

    def _poke(self, deadline):
        """Wake the scheduler early if it sleeps past a new deadline."""
        wake = self._wake
        if wake is not None and not wake.done() and deadline < self._wake_at:
            wake.set_result(None)

    async def _scheduler(self):
        """Write every chunk whose deadline has passed; sleep, then spin, until the next one."""
        loop = asyncio.get_running_loop()
        firsts, nexts = self.firsts, self.nexts
        gap, spin, clock = self.schedule.gap_ms / 1000, self.schedule.spin_us / 1e6, perf_counter
        while True:
            now = clock()
            # Due first chunks, then due next chunks; at most a batch before letting requests in.
            self._write_due(firsts, now, 16, gap, first=True)
            self._write_due(nexts, now, 32, gap, first=False)
            heads = [q[0][0] for q in (firsts, nexts) if q]
            wait = min(heads) - clock() if heads else 3600.0
            if wait <= spin:
                await asyncio.sleep(0)
                continue
            self._wake_at = clock() + wait - spin
            self._wake = loop.create_future()
            handle = loop.call_later(wait - spin, _resolve, self._wake)
            await self._wake
            handle.cancel()
            self._wake = None

    def _write_due(self, queue, now, budget, gap, first):
        counts, truth = self.lateness.counts, self.truth_ttft if first else self.truth_itl
        heap = not isinstance(queue, deque)
        nexts, popleft, clock, generated = self.nexts, (None if heap else queue.popleft), perf_counter, 0
        while queue and budget and queue[0][0] <= now:
            if heap:
                deadline, _, stream = heapq.heappop(queue)
            else:
                deadline, stream = popleft()
            budget -= 1
            i = stream.next
            try:
                if stream.transport.is_closing():  # the client went away: vLLM aborts the request, generates no more
                    raise RuntimeError("closed")
                stream.transport.write(stream.frames[i])
            except (AttributeError, RuntimeError):
                _resolve(stream.done)
                continue
            wrote = clock()
            late = wrote - deadline
            counts[int(late * 100_000) if late < 0.1 else -1] += 1
            truth.append(wrote - (stream.anchor if first else stream.last))
            if first:
                stream.first = wrote
            stream.last = wrote
            generated += stream.sizes[i]
            stream.next = i = i + 1
            if i < len(stream.frames):
                if heap or not isinstance(nexts, deque):
                    heapq.heappush(nexts, (deadline + stream.gap, next(self._seq), stream))
                else:
                    nexts.append((deadline + gap, stream))
            else:
                _resolve(stream.done)
        self.generation_tokens_total += generated


def _resolve(future):
    if not future.done():
        future.set_result(None)


class SchedServer:
    """Runs the server in a background thread: `with SchedServer(ttft_ms=50) as s: s.base_url`."""

    def __init__(self, host="127.0.0.1", port=0, **schedule):
        self.host, self.port = host, port
        self.schedule = Schedule(**schedule)
        self.server = Server(self.schedule)
        self._ready = threading.Event()
        self._thread = None
        self._loop = None
        self._runner = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, name="schedserver", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("schedserver did not start")
        return self

    def __exit__(self, *exc):
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(10)
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self):
        self._loop = new_loop()
        asyncio.set_event_loop(self._loop)
        self._runner = self._loop.run_until_complete(_serve(self.server, self.host, self.port))
        self.port = self._runner.addresses[0][1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()


async def _serve(server, host, port):
    runner = web.ServerRunner(ArrivalServer(server.handle, access_log=None), handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=4096).start()
    server.start()
    return runner


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--ttft-ms", type=float, default=50.0)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--tokens-per-chunk", type=int, default=1)
    parser.add_argument("--reasoning-tokens", type=int, default=0)
    parser.add_argument("--default-max-tokens", type=int, default=128)
    parser.add_argument("--reasoning-field", default="reasoning")
    parser.add_argument("--spin-us", type=float, default=1500.0)
    parser.add_argument("--zero-delay", action="store_true")
    parser.add_argument("--role-with-first-token", action="store_true",
                        help="send the role chunk with the first token, as vLLM does (vllm bench serve counts it)")
    parser.add_argument("--no-uvloop", action="store_true")
    parser.add_argument("--gc", action="store_true", help="keep automatic garbage collection on")
    parser.add_argument("--jitter", type=float, default=0.0, help="each request's gap drawn from gap * (1 ± jitter)")
    parser.add_argument("--seed", type=int, default=0, help="of the jitter: the same seed draws the same gaps")
    parser.add_argument("--slots", type=int, default=0, help="requests served at once (the rest queue); 0: no limit")
    parser.add_argument("--vllm", action="store_true",
                        help="answer as vLLM does (tests/schedvllm.py): the fake vLLM's HTTP side")
    parser.add_argument("--served-model-name", default="sched")
    parser.add_argument("--max-model-len", type=int, default=1 << 20)
    parser.add_argument("--wait-stdin", action="store_true",
                        help="bind only once a line arrives on stdin (the fake vLLM's load ends: imports are done by then)")
    args = parser.parse_args(argv)
    schedule = Schedule(ttft_ms=args.ttft_ms, gap_ms=args.gap_ms, tokens_per_chunk=args.tokens_per_chunk,
                        reasoning_tokens=args.reasoning_tokens, default_max_tokens=args.default_max_tokens,
                        zero_delay=args.zero_delay, reasoning_field=args.reasoning_field, spin_us=args.spin_us,
                        role_with_first_token=args.role_with_first_token, jitter=args.jitter, seed=args.seed,
                        slots=args.slots)
    raise_fd_limit()
    if args.wait_stdin:
        sys.stdin.readline()
    if not args.gc:
        gc.disable()  # a collection mid-level would delay chunks; /stats?reset=1 collects instead
    loop = asyncio.new_event_loop() if args.no_uvloop else new_loop()
    face = VllmFace(args.served_model_name, args.max_model_len) if args.vllm else None
    runner = loop.run_until_complete(_serve(Server(schedule, face), args.host, args.port))
    if face is not None:
        face.on_core_death(loop)
    print(f"schedserver listening on http://{args.host}:{runner.addresses[0][1]}", flush=True)
    try:
        loop.run_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
