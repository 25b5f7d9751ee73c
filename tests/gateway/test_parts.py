"""The gateway's parts on their own: limits, the stream relay, media URLs, usage fields, key checks."""
import asyncio

import pytest

from deployments.gateway import keyset, media, stream, usage
from deployments.gateway.config import Key, Snapshot, digest
from deployments.gateway.keyset import Refused
from deployments.gateway.limits import Admission, KeyLimits, MinuteWindow, TokenBucket, retry_after_header
from tests.conftest import run_async


def key(**fields) -> Key:
    base = dict(id=1, prefix="vcp-abcdefgh", model_names=frozenset(), deployments=frozenset(), expires_at=None,
                revoked=False, internal=False, rps=None, tpm=None, concurrency=None)
    return Key(**{**base, **fields})


def test_the_token_bucket_lets_through_its_rate_after_a_one_second_burst():
    bucket, now, passed = TokenBucket(), 100.0, 0
    for _ in range(1000):  # 10 s of a request every 10 ms against 20 per second
        if bucket.take(20.0, now) == 0:
            passed += 1
        now += 0.01
    assert 20 + 200 - 2 <= passed <= 20 + 200 + 1
    empty = TokenBucket()
    empty.take(2.0, 0.0), empty.take(2.0, 0.0)
    assert empty.take(2.0, 0.0) == pytest.approx(0.5)


def test_the_minute_window_says_when_enough_tokens_have_left_it():
    window = MinuteWindow()
    window.add(60, 10.2)
    window.add(50, 30.5)
    assert window.wait(200, 31.0) == 0
    assert window.wait(100, 31.0) == pytest.approx(10 + 60 - 31.0)  # the first slot leaves at 70 s
    assert window.wait(100, 70.0) == 0


def test_key_limits_count_concurrency_and_refuse_with_a_retry_time():
    limits, k = KeyLimits(), key(concurrency=2, tpm=100)
    limits.admit(k, now=0.0), limits.admit(k, now=0.0)
    with pytest.raises(Refused) as refused:
        limits.admit(k, now=0.0)
    assert refused.value.status == 429 and refused.value.retry_after == 1.0
    limits.done(150, now=1.0)
    with pytest.raises(Refused) as refused:
        limits.admit(k, now=2.0)
    assert refused.value.retry_after == pytest.approx(59.0)
    assert retry_after_header(0.05) == "1" and retry_after_header(59.2) == "60"


def test_admission_queues_in_order_and_refuses_beyond_its_queue():
    async def scenario():
        gate, order = Admission(), []
        await gate.acquire(1, 2, "d")

        async def later(i):
            await gate.acquire(1, 2, "d")
            order.append(i)

        waiting = [asyncio.ensure_future(later(i)) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Refused) as refused:
            await gate.acquire(1, 2, "d")
        assert refused.value.status == 429
        gate.release(1)
        await asyncio.sleep(0)
        gate.release(1)
        await asyncio.gather(*waiting)
        gate.release(1)
        return order, gate.in_flight, len(gate.waiters)

    assert run_async(scenario()) == ([0, 1], 0, 0)


def test_a_cancelled_waiter_leaves_the_queue():
    async def scenario():
        gate = Admission()
        await gate.acquire(1, 4, "d")
        task = asyncio.ensure_future(gate.acquire(1, 4, "d"))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        gate.release(1)
        return gate.in_flight, len(gate.waiters)

    assert run_async(scenario()) == (0, 0)


USAGE_EVENT = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5,"total_tokens":8,' \
              b'"completion_tokens_details":{"reasoning_tokens":2}}}\n\n'
TOKEN_EVENT = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"w "}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def relay(pieces, strip):
    """What the caller gets for `pieces` read from the engine: (all bytes, each write, the usage seen)."""
    forward = stream.Relay(strip)
    writes = [w for w in (forward.feed(p) for p in pieces) if w]
    rest = forward.close()
    writes += [rest] if rest else []
    return b"".join(writes), writes, forward.tokens


@pytest.mark.parametrize("cut", [1, 7, 40, 120, len(TOKEN_EVENT) + 5])
def test_the_relay_strips_the_usage_event_wherever_the_reads_cut_it(cut):
    whole = TOKEN_EVENT * 2 + USAGE_EVENT + DONE
    pieces = [whole[i:i + cut] for i in range(0, len(whole), cut)]
    body, _, tokens = relay(pieces, strip=True)
    assert body == TOKEN_EVENT * 2 + DONE
    assert (tokens.prompt, tokens.completion, tokens.reasoning) == (3, 5, 2)
    kept, _, _ = relay(pieces, strip=False)
    assert kept == whole


def test_the_relay_forwards_each_whole_event_as_it_arrives():
    _, writes, tokens = relay([TOKEN_EVENT, TOKEN_EVENT + TOKEN_EVENT[:10], TOKEN_EVENT[10:]], strip=True)
    assert writes == [TOKEN_EVENT, TOKEN_EVENT, TOKEN_EVENT] and tokens is None


def test_usage_fields_of_every_api():
    chat = usage.tokens_of({"prompt_tokens": 4, "completion_tokens": 9, "completion_tokens_details": {"reasoning_tokens": 3}})
    responses = usage.from_event({"type": "response.completed", "response": {"usage": {
        "input_tokens": 5, "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 1}}}})
    embeddings = usage.tokens_of({"prompt_tokens": 6, "total_tokens": 6})
    assert (chat.prompt, chat.completion, chat.reasoning) == (4, 9, 3)
    assert (responses.prompt, responses.completion, responses.reasoning) == (5, 7, 1)
    assert (embeddings.prompt, embeddings.completion, embeddings.reasoning) == (6, 0, 0)
    assert usage.tokens_of(None) is None and usage.tokens_of({"prompt_tokens": "x"}) is None


def test_media_urls_are_found_in_chat_and_responses_bodies():
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "see https://not-a-media-url.example"},
        {"type": "image_url", "image_url": {"url": "https://a.example/x.png"}},
        {"type": "audio_url", "audio_url": {"url": "http://b.example/x.wav"}},
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}],
        "input": [{"content": [{"type": "input_image", "image_url": "https://c.example/y.png"}]}]}
    assert sorted(media.urls(body)) == ["data:video/mp4;base64,AAAA", "http://b.example/x.wav",
                                        "https://a.example/x.png", "https://c.example/y.png"]
    assert media.refused(media.urls(body), ("a.example", "b.example", "c.example")) is None
    assert media.refused(media.urls(body), ("a.example",)) in {"http://b.example/x.wav", "https://c.example/y.png"}
    assert not media.allowed("https://a.example@evil.org/x.png", ("a.example",))
    assert not media.allowed("https://[::1]/x.png", ("a.example",))


def test_keys_are_checked_by_digest_and_scope():
    secret = "vcp-" + "s" * 43
    snapshot = Snapshot(keys={digest(secret): key(model_names=frozenset({"kimi"}))}, by_name={"kimi": [1], "glm": [2]})
    assert keyset.authenticate(snapshot, f"Bearer {secret}").id == 1
    for header in ("", "Basic abc", f"Bearer {secret}x", secret):
        with pytest.raises(Refused) as refused:
            keyset.authenticate(snapshot, header)
        assert refused.value.status == 401
    k = snapshot.keys[digest(secret)]
    assert keyset.scope_check(snapshot, k, "kimi") == [1]
    with pytest.raises(Refused) as refused:
        keyset.scope_check(snapshot, k, "glm")
    assert refused.value.status == 403
    with pytest.raises(Refused) as refused:
        keyset.scope_check(snapshot, k, "none")
    assert refused.value.status == 404 and refused.value.body()["error"]["code"] == "model_not_found"
    assert keyset.names_for(snapshot, k) == ["kimi"]
