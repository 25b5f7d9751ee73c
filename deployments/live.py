"""The one place that knows live group names and payload shapes, and the only caller of group_send.

Browsers subscribe to topics ("fleet", "node:<id>", "deployment:<id>", "model:<id>", "run:<id>").
Each message is {"topic", "kind", "data"}. The last message of each kind per topic is kept in Redis
as that topic's snapshot, so a browser that (re)connects first gets the current state, then deltas.
"""
import json
import logging
import re
from typing import Any, TypedDict

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from controlpanel import redisconn

TOPIC_RE = re.compile(r"^(fleet|(node|deployment|model|run):[0-9]{1,12})$")
SNAPSHOT_TTL = 3600


class LiveMessage(TypedDict):
    topic: str
    kind: str
    data: Any


def valid_topic(topic: str) -> bool:
    return bool(TOPIC_RE.match(topic or ""))


def group_name(topic: str) -> str:
    """Channels group for a topic (group names allow letters, digits, '-', '_', '.')."""
    return "live." + topic.replace(":", ".")


def node_topic(node_id: int) -> str:
    return f"node:{node_id}"


def deployment_topic(deployment_id: int) -> str:
    return f"deployment:{deployment_id}"


def model_topic(model_id: int) -> str:
    return f"model:{model_id}"


def run_topic(run_id: int) -> str:
    return f"run:{run_id}"


log = logging.getLogger(__name__)
FLEET = "fleet"


def _snapshot_key(topic: str) -> str:
    return redisconn.key("snapshot", topic)


def publish(topic: str, kind: str, data: Any, keep: bool = True) -> None:
    """Send one message to every browser watching `topic`; keep it as the topic's snapshot of `kind`."""
    message: LiveMessage = {"topic": topic, "kind": kind, "data": data}
    try:
        if keep:
            key = _snapshot_key(topic)
            pipe = redisconn.client().pipeline()
            pipe.hset(key, kind, json.dumps(message))
            pipe.expire(key, SNAPSHOT_TTL)
            pipe.execute()
        async_to_sync(get_channel_layer().group_send)(group_name(topic), {"type": "live.message", "message": message})
    except (redis.RedisError, OSError) as exc:
        # Browsers miss this update (they get a fresh snapshot on reconnect); the caller's work,
        # recorded in the database, must not fail because Redis is away.
        log.warning("live update %s/%s not sent: %s", topic, kind, exc)


def snapshot(topic: str) -> list[LiveMessage]:
    """The last kept message of each kind for a topic (read by the consumer on subscribe)."""
    raw = redisconn.client().hgetall(_snapshot_key(topic))
    return [json.loads(value) for value in raw.values()]


def kept(topics: list[str], kind: str) -> list[Any]:
    """The data of each topic's kept message of `kind` (None where none is kept), in one round trip."""
    pipe = redisconn.client().pipeline()
    for topic in topics:
        pipe.hget(_snapshot_key(topic), kind)
    return [json.loads(raw)["data"] if raw else None for raw in pipe.execute()]
