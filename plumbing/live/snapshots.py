"""Kept snapshots: the last message of each kind per topic, in a Redis hash, so that a browser that (re)connects
first gets the current state, then deltas; and what a subscriber gets, the kept messages plus what the topic's
registered kind adds (plumbing.live.topics)."""
import json
from typing import Any

from plumbing import redisconn
from plumbing.live import topics

SNAPSHOT_TTL = 3600


def snapshot_key(topic: str) -> str:
    return redisconn.key("snapshot", topic)


def keep(pipe, message: dict[str, Any]) -> None:
    """Add to `pipe` the commands that keep `message` as its topic's snapshot of its kind."""
    key = snapshot_key(message["topic"])
    pipe.hset(key, message["kind"], json.dumps(message))
    pipe.expire(key, SNAPSHOT_TTL)


def snapshot(topic: str) -> list[dict[str, Any]]:
    """The last kept message of each kind for a topic."""
    raw = redisconn.client().hgetall(snapshot_key(topic))
    return [json.loads(value) for value in raw.values()]


def kept(topic_names: list[str], kind: str) -> list[dict[str, Any] | None]:
    """The data of each topic's kept message of `kind` (None where none is kept), in one round trip."""
    pipe = redisconn.client().pipeline(transaction=False)  # reads only: no MULTI/EXEC needed
    for topic in topic_names:
        pipe.hget(snapshot_key(topic), kind)
    return [json.loads(raw)["data"] if raw else None for raw in pipe.execute()]


def on_subscribe(topic: str) -> list[dict[str, Any]]:
    """What a browser gets when it subscribes to `topic` (read by the consumer): the kept messages, then those
    its kind's `snapshot` adds."""
    messages = snapshot(topic)
    known = topics.registered(topic)
    if known is not None and known[0].snapshot is not None and known[1] is not None:
        messages += known[0].snapshot(known[1], messages)
    return messages
