"""The streaming parser: chunked HTTP and SSE from raw bytes, however the reads split them."""
import json

import pytest

from benchmarks.runner.spec import RequestRecord
from benchmarks.runner import stream
from benchmarks.runner.stream import Connection, Counters
from tests.conftest import run_async


class FakeTransport:
    def __init__(self):
        self.written, self.aborted = [], False

    def write(self, data):
        self.written.append(data)

    def abort(self):
        self.aborted = True

    def close(self):
        self.aborted = True


def sse(obj):
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def chunked(*events):
    return b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
ROLE = sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
REASON = sse({"choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]})
TOOL = sse({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]})
TEXT = sse({"choices": [{"index": 0, "delta": {"content": "Hi \"content\": there"}}]})
NULL = sse({"choices": [{"index": 0, "delta": {"content": None}, "finish_reason": "stop"}]})
USAGE = sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3,
                                      "completion_tokens_details": {"reasoning_tokens": 1}}})
BODY = HEAD + chunked(ROLE, REASON, TOOL, TEXT, NULL, USAGE, sse(b"[DONE]"))


@pytest.fixture
def run(monkeypatch):
    """Feed a response in pieces, one read each; read i arrives at time i."""
    return lambda pieces: _run(pieces, monkeypatch)


def _run(pieces, monkeypatch):
    done = []
    conn = Connection(Counters())
    conn.transport = FakeTransport()
    record = RequestRecord(index=0, start=-1.0)
    conn.record, conn._on_done = record, lambda c, r, reusable, retry: done.append(reusable)
    conn._state, conn._buf, conn._sse, conn._left = 0, b"", b"", 0
    conn._status, conn._keep_alive, conn._error_body, conn._cum_tokens, conn._timer = 0, True, [], 0, None
    for i, piece in enumerate(pieces):
        monkeypatch.setattr(stream, "perf_counter", lambda i=i: float(i))
        conn.data_received(piece)
    return record, done


def test_role_only_and_empty_chunks_are_not_tokens_but_reasoning_and_tool_calls_are(run):
    record, done = run([BODY])
    assert bytes(record.chunk_kinds) == b"rtc"
    assert (record.output_tokens, record.prompt_tokens, record.reasoning_tokens) == (3, 4, 1)
    assert record.success and done == [True]


@pytest.mark.parametrize("size", [1, 2, 7, 64])
def test_any_split_of_the_bytes_parses_the_same(run, size):
    record, done = run([BODY[i:i + size] for i in range(0, len(BODY), size)])
    assert bytes(record.chunk_kinds) == b"rtc" and record.output_tokens == 3 and done == [True]


def test_each_chunk_is_stamped_with_the_read_it_arrived_in(run):
    head_and_role = HEAD + chunked(ROLE, REASON)[:-5]  # without the final 0-chunk
    rest = chunked(TOOL, TEXT, NULL, USAGE, sse(b"[DONE]"))
    record, _ = run([head_and_role, rest])
    assert record.chunk_times == [0.0, 1.0, 1.0]


def test_continuous_usage_gives_the_tokens_of_each_chunk(run):
    events = [sse({"choices": [{"delta": {"content": "ab"}}], "usage": {"completion_tokens": n}}) for n in (2, 5)]
    record, _ = run([HEAD + chunked(*events, USAGE)])
    assert record.chunk_tokens == [2, 3]


def test_tokens_of_a_chunk_without_text_count_with_the_next_chunk(run):
    # vLLM sends "reasoning": "" for a token that ends inside a UTF-8 character.
    empty = sse({"choices": [{"delta": {"reasoning": ""}}], "usage": {"completion_tokens": 1}})
    text = sse({"choices": [{"delta": {"reasoning": "é"}}], "usage": {"completion_tokens": 2}})
    record, _ = run([HEAD + chunked(empty, text, USAGE)])
    assert bytes(record.chunk_kinds) == b"r" and record.chunk_tokens == [2]


def test_a_reused_connection_closed_before_any_answer_asks_for_a_retry(monkeypatch):
    async def scenario():
        calls = []
        conn = Connection(Counters())
        conn.transport = FakeTransport()
        on_done = lambda c, record, reusable, retry: calls.append((record.index, reusable, retry))  # noqa: E731
        first = RequestRecord(index=0)
        conn.send(first, b"POST 1", on_done, 60)
        conn.data_received(BODY)
        conn.send(RequestRecord(index=1), b"POST 2", on_done, 60)
        conn.connection_lost(None)  # the server had closed the idle connection
        return calls

    import asyncio
    assert run_async(scenario()) == [(0, True, b""), (1, False, b"POST 2")]


def test_an_error_status_fails_the_request_with_the_servers_message(run):
    body = json.dumps({"error": {"message": "model 'x' does not exist"}}).encode()
    response = b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    record, done = run([response])
    assert not record.success and record.error == "HTTP 404: model 'x' does not exist"
    assert done == [True]


def test_a_stream_without_tokens_is_a_failure(run):
    record, _ = run([HEAD + chunked(ROLE, USAGE, sse(b"[DONE]"))])
    assert not record.success and record.error == "the stream carried no tokens"


def test_the_role_only_chunk_is_where_vllm_bench_serves_ttft_ends_but_not_ours(run):
    # ROLE arrives in read 0, the first token (REASON) in read 1: vllm bench serve's TTFT stops at the
    # first chunk carrying a choice, ours at the first token.
    record, _ = run([HEAD + chunked(ROLE)[:-5], chunked(REASON, TEXT, USAGE, sse(b"[DONE]"))])
    assert record.first_choice == 0.0 and record.chunk_times[0] == 1.0
    assert record.ttft_vllm_bench == 1.0 and record.ttft == 2.0  # start is -1.0


def test_without_a_role_chunk_both_ttfts_end_at_the_first_token(run):
    record, _ = run([HEAD + chunked(TEXT)[:-5], chunked(USAGE, sse(b"[DONE]"))])
    assert record.first_choice is None and record.ttft_vllm_bench == record.ttft == 1.0
