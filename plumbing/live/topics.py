"""Topics and the groups behind them, and the registry each app fills in its AppConfig.ready().

A browser subscribes to topics: "<kind>:<id>" ("node:3", "run:12") or a kind without an id ("fleet").
The app that owns a kind registers it with the ids that may be subscribed to (objects that exist) and,
optionally, what to add to the kept snapshot on subscribe. The messages themselves are the apps' own
(their payloads.py), published through plumbing.live.publishing.
"""
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

_ID = re.compile(r"[0-9]{1,12}")


@dataclass(frozen=True)
class Topic:
    """One kind of topic. `existing(ids)` says which of the ids a browser may subscribe to (None: the kind has no
    id, its one topic always exists); `snapshot(id, kept)` returns messages to send after the kept ones (what
    Redis forgot, read from the database)."""

    kind: str
    existing: Callable[[list[int]], Iterable[int]] | None = None
    snapshot: Callable[[int, list[dict[str, Any]]], list[dict[str, Any]]] | None = None

    def name(self, object_id: int) -> str:
        return f"{self.kind}:{object_id}"


_registry: dict[str, Topic] = {}


def register(*kinds: Topic) -> None:
    """Make topics of these kinds subscribable (called from AppConfig.ready; registering again replaces)."""
    for topic in kinds:
        _registry[topic.kind] = topic


def exists_in(model) -> Callable[[list[int]], Iterable[int]]:
    """`existing` for a topic per row of `model`: the ids among those asked with a row, one query."""
    return lambda ids: model.objects.filter(pk__in=ids).values_list("pk", flat=True)


def registered(topic: str) -> tuple[Topic, int | None] | None:
    """The registered kind of a well-formed topic and its id (None for a kind without ids), else None."""
    kind, colon, number = topic.partition(":")
    found = _registry.get(kind)
    if found is None:
        return None
    if found.existing is None:
        return None if colon else (found, None)
    return (found, int(number)) if _ID.fullmatch(number) else None


def valid_topic(topic: str) -> bool:
    return isinstance(topic, str) and registered(topic) is not None


def existing(topics: list[str]) -> set[str]:
    """The topics among `topics` that may be subscribed to (their object exists); one query per kind."""
    found, by_kind = set(), {}
    for topic in topics:
        known = registered(topic)
        if known is None:
            continue
        kind, object_id = known
        if object_id is None:
            found.add(topic)
        else:
            by_kind.setdefault(kind, {})[object_id] = topic
    for kind, ids in by_kind.items():
        found |= {ids[pk] for pk in kind.existing(list(ids))}
    return found


def group_name(topic: str) -> str:
    """Channels group for a topic (group names allow letters, digits, '-', '_', '.')."""
    return "live." + topic.replace(":", ".")


def user_group(user_id: int) -> str:
    return f"live.user.{int(user_id)}"


def session_group(session_key: str) -> str:
    return f"live.session.{session_key}"


def socket_group(channel_name: str) -> str:
    """A group of one socket alone, for its heartbeat (group names allow no "!")."""
    return "live.socket." + channel_name.replace("!", ".")
