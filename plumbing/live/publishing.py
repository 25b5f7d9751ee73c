"""Publishing: the only caller of group_send for live messages, and the nudges that reach open sockets.

Each message is {"topic", "kind", "data"}, `data` being one of an app's payload dataclasses as a JSON
object (deployments/payloads.py, benchmarks/payloads.py: one sender per message, so each payload goes to
the same topics every time). The message is kept as its topic's snapshot of its kind (unless keep=False)
and handed to the Channels layer; the browser code in static/panel/ reads the field names.
"""
import logging
from dataclasses import fields
from typing import Any, TypedDict

import redis

from plumbing import redisconn
from plumbing.live import sender, snapshots, topics

log = logging.getLogger(__name__)


class LiveMessage(TypedDict):
    topic: str
    kind: str
    data: dict[str, Any]  # asdict() of one of the apps' payload dataclasses


def pick(cls, obj, **given):
    """An instance of the payload dataclass `cls` from obj's attributes of the same names, plus `given`."""
    return cls(**{f.name: given[f.name] if f.name in given else getattr(obj, f.name) for f in fields(cls)})


def publish(topic: str, kind: str, data: dict[str, Any], keep: bool = True, also=None) -> None:
    """Send one message to every browser watching `topic`; keep it as the topic's snapshot of `kind`.
    `also(pipe)` adds commands to the same Redis round trip."""
    message: LiveMessage = {"topic": topic, "kind": kind, "data": data}
    try:
        if keep or also:
            pipe = redisconn.client().pipeline()
            if keep:
                snapshots.keep(pipe, message)
            if also:
                also(pipe)
            pipe.execute()
    except (redis.RedisError, OSError) as exc:
        # Browsers miss this update (they get a fresh snapshot on reconnect); the caller's work,
        # recorded in the database, must not fail because Redis is away.
        log.warning("live update %s/%s not sent: %s", topic, kind, exc)
        return
    sender.group_send(topics.group_name(topic), {"type": "live.message", "message": message}, f"update {topic}/{kind}")


def _send_control(group: str, kind: str) -> None:
    sender.group_send(group, {"type": kind}, f"{kind} to {group}")


def end_session(session_key: str) -> None:
    """Close the WebSockets opened with this session (its user logged out)."""
    _send_control(topics.session_group(session_key), "session.end")


def recheck_user(user_id: int) -> None:
    """Make the user's WebSockets check their role again now (groups or account changed)."""
    _send_control(topics.user_group(user_id), "session.recheck")
