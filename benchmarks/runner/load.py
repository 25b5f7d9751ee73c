"""One process's share of a level: a semaphore-bounded stream of requests on keep-alive connections."""
import asyncio
import time

from .prompts import Request
from .spec import RequestRecord
from .stream import Connection, Counters, open_connection, tls_context

CONNECT_PARALLELISM = 64  # connection attempts at once; a burst of 1024 SYNs overflows accept queues
CANCEL_POLL_S = 0.02
SPIN_S = 0.002  # a due time is slept towards until this close, then spun to: loop timers are ~1 ms precise


class Pool:
    """Idle keep-alive connections to one server."""

    def __init__(self, target, verify_tls: bool, counters: Counters):
        self.target, self.counters = target, counters
        self.tls = tls_context(verify_tls) if target.tls else None
        self.idle: list[Connection] = []
        self._connecting = asyncio.Semaphore(CONNECT_PARALLELISM)

    def take(self) -> Connection | None:
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed:
                return conn
        return None

    async def connect(self) -> Connection:
        async with self._connecting:
            return await open_connection(self.target.host, self.target.port, self.tls, self.counters)

    def close(self):
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


async def until(at: float) -> None:
    """Return at perf_counter() `at`, not before: sleep, then spin the last SPIN_S (yielding, so
    responses are read meanwhile)."""
    clock = time.perf_counter
    wait = at - clock()
    if wait > SPIN_S:
        await asyncio.sleep(wait - SPIN_S)
    while clock() < at:
        await asyncio.sleep(0)


async def run_share(pool: Pool, requests: list, concurrency: int, cancelled, report=None, tick_s: float = 0.5,
                    busy_poll: bool = False, due: list | None = None, start_at: float = 0.0, turns: int = 0,
                    think=None) -> tuple[list[RequestRecord], bool]:
    """Send `requests` (prompts.Request: each with its own timeout) at most `concurrency` at a time; measured
    records back.

    With `due` (a rate level) request i is sent no earlier than start_at + due[i], then as soon as a
    slot is free; each record keeps its due time and how long it waited for a slot.

    With `turns` (a multi-turn level) each of `concurrency` users sends one conversation (`turns`
    consecutive requests) at a time: a turn goes once the answer to the one before it has ended and
    `think(index)` more seconds have passed, and then the user takes the next conversation. With `turns`
    and `due` (a multi-turn rate level) conversation k starts at start_at + due[k] whatever else is in
    flight (at most `concurrency` requests at once); its first turn keeps that due time and its slot wait.

    `cancelled()` is checked before each request and every 20 ms; on cancel the requests in flight
    are aborted and left out. `report(counters)` is called every `tick_s`. With `busy_poll` the loop
    never sleeps in epoll: a chunk then needs no wake-up (costly on VMs) and is stamped sooner.
    """
    loop = asyncio.get_running_loop()
    counters = pool.counters
    semaphore = asyncio.Semaphore(max(1, concurrency))
    records: list[RequestRecord] = []
    in_flight: set[Connection] = set()
    state = {"outstanding": 0, "dispatched": False, "cancelled": False}
    finished = loop.create_future()
    tasks = set()
    answered: dict[int, asyncio.Future] = {}  # id(record) -> resolved when its response has ended
    stopped = loop.create_future()  # resolved on cancel: wakes the users of a multi-turn level mid-think

    def on_done(conn, record, reusable, retry=b""):
        in_flight.discard(conn)
        if retry and not state["cancelled"]:
            record.start = 0.0  # the stale connection cost the server nothing: start over
            again = Request(record.index, record.warmup, retry, record.timeout_s)
            task = loop.create_task(connect_and_send(record, again))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            return
        counters.in_flight -= 1
        if record.success:
            counters.completed += 1
            counters.tokens += record.output_tokens
            counters.token_chunks += len(record.chunk_times)
        else:
            counters.failed += 1
        if not record.warmup and not state["cancelled"]:
            records.append(record)
        if (waiter := answered.pop(id(record), None)) is not None:
            waiter.set_result(None)
        if reusable:
            pool.idle.append(conn)
        elif conn.transport is not None:
            conn.transport.abort()
        semaphore.release()
        state["outstanding"] -= 1
        if state["dispatched"] and not state["outstanding"] and not finished.done():
            finished.set_result(None)

    def send(conn, record, request):
        in_flight.add(conn)
        record.timeout_s = request.timeout_s
        conn.send(record, request.data, on_done, request.timeout_s)

    async def connect_and_send(record, request):
        record.start = record.start or time.perf_counter()  # connection setup counts, as in vllm bench serve
        try:
            conn = await pool.connect()
        except asyncio.CancelledError:
            record.done, record.error = time.perf_counter(), "cancelled"
            on_done(_Unsent(), record, False)
            raise
        except (OSError, asyncio.TimeoutError) as exc:
            record.done = time.perf_counter()
            record.error = f"cannot connect to {pool.target.host}:{pool.target.port}: {exc or 'timeout'}"
            return on_done(_Unsent(), record, False)
        send(conn, record, request)

    async def watch():
        while not finished.done():
            if cancelled():
                state["cancelled"] = True
                stopped.set_result(None)
                for conn in list(in_flight):
                    conn.fail("cancelled")
                for task in list(tasks):
                    task.cancel()
                return
            await asyncio.sleep(CANCEL_POLL_S)

    async def ticker():
        while not finished.done():
            await asyncio.sleep(tick_s)
            report(counters)

    async def spin():
        while not finished.done():
            await asyncio.sleep(0)

    background = [loop.create_task(watch())]
    if busy_poll:
        background.append(loop.create_task(spin()))
    if report is not None:
        background.append(loop.create_task(ticker()))
    def dispatch(record, request):
        state["outstanding"] += 1
        counters.in_flight += 1
        conn = pool.take()
        if conn is None:
            record.start = time.perf_counter()
            task = loop.create_task(connect_and_send(record, request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        else:
            send(conn, record, request)  # takes the start time right before the write

    def stop_now() -> bool:
        if state["cancelled"] or cancelled():
            state["cancelled"] = True
        return state["cancelled"]

    async def converse(conversation, due_at: float = 0.0) -> bool:
        """One conversation's turns in order, each after the answer before it and its think time; the first
        keeps its due time (a rate level's). False once cancelled."""
        record = None
        for request in conversation:
            index, warmup = request.index, request.warmup
            wait = think(index) if record is not None and think is not None else 0.0
            if wait > 0:  # the think time counts from the answer's end
                at = record.done + wait
                if at - time.perf_counter() > SPIN_S:  # a cancel must not wait out a long think
                    await asyncio.wait([stopped], timeout=at - time.perf_counter() - SPIN_S)
                if not stopped.done():
                    await until(at)
            waiting = time.perf_counter() if record is None and due_at and semaphore.locked() else 0.0
            await semaphore.acquire()
            if stop_now():
                semaphore.release()
                return False
            record = RequestRecord(index=index, warmup=warmup, due=due_at if index % turns == 0 else 0.0)
            if waiting:
                record.slot_wait = time.perf_counter() - waiting
            answered[id(record)] = loop.create_future()
            waiter = answered[id(record)]
            dispatch(record, request)
            await waiter
        return True

    async def user(conversations):
        for conversation in conversations:
            if not await converse(conversation):
                return

    async def arrivals(conversations):
        """A multi-turn rate level: each conversation starts at its own due time, in due order."""
        started = []
        for conversation in conversations:
            await until(start_at + due[conversation[0].index // turns])
            if stop_now():
                break
            started.append(loop.create_task(converse(conversation, start_at + due[conversation[0].index // turns])))
        await asyncio.gather(*started)

    try:
        if turns and due is not None:
            await arrivals(_conversations(requests, turns))
            requests = ()
        elif turns:
            shared = _conversations(requests, turns)
            await asyncio.gather(*(user(shared) for _ in range(max(1, concurrency))))
            requests = ()
        for request in requests:
            index, warmup = request.index, request.warmup
            if due is None:
                await semaphore.acquire()
                record = RequestRecord(index=index, warmup=warmup)
            else:
                record = RequestRecord(index=index, warmup=warmup, due=start_at + due[index])
                await until(record.due)
                if semaphore.locked():
                    waiting = time.perf_counter()
                    await semaphore.acquire()
                    record.slot_wait = time.perf_counter() - waiting
                else:
                    await semaphore.acquire()
            if stop_now():
                semaphore.release()
                break
            dispatch(record, request)
        state["dispatched"] = True
        if not state["outstanding"]:
            finished.set_result(None)
        await finished
    finally:
        if not finished.done():
            finished.set_result(None)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    if report is not None:
        report(counters)
    records.sort(key=lambda r: r.index)
    return records, state["cancelled"]


def _conversations(requests, turns: int):
    """Consecutive requests grouped by conversation (index // turns), one list per conversation."""
    conversation, current = None, []
    for item in requests:
        if item.index // turns != conversation and current:
            yield current
            current = []
        conversation = item.index // turns
        current.append(item)
    if current:
        yield current


class _Unsent:
    """Stands for the connection a request never got."""

    transport = None
