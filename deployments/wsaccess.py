"""Who may keep a live WebSocket: the checks the consumer runs on connect, on a timer and on a nudge.

A socket outlives the request that opened it, so logging out, losing the role or being
deactivated must reach sockets already open: logout and role changes send their sockets a group
message (see live.end_session / live.recheck_user), and each socket re-checks on a timer anyway
(session expiry, changes made straight in the database). Subscriptions are to objects that exist.
"""
from django.apps import apps
from django.contrib.auth import get_user_model
from django.contrib.sessions.models import Session
from django.utils import timezone

from plumbing.roles import is_viewer

# topic kind -> (app label, model name)
_MODELS = {"node": ("deployments", "Node"), "deployment": ("deployments", "Deployment"),
           "model": ("deployments", "ModelRepo"), "run": ("benchmarks", "BenchmarkRun"),
           "study": ("benchmarks", "Study")}


def close_code(user_id: int | None, session_key: str | None) -> int | None:
    """None while the socket may stay open; 4401 when the session ended, 4403 when the role went."""
    if session_key and not Session.objects.filter(session_key=session_key, expire_date__gt=timezone.now()).exists():
        return 4401
    user = get_user_model().objects.filter(pk=user_id, is_active=True).first() if user_id else None
    if user is None:
        return 4401
    return None if is_viewer(user) else 4403


def existing(topics: list[str]) -> set[str]:
    """The topics among `topics` whose object exists ("fleet" always does); one query per kind."""
    found = {t for t in topics if t == "fleet"}
    by_kind: dict[str, dict[int, str]] = {}
    for topic in topics:
        kind, _, pk = topic.partition(":")
        if kind in _MODELS:
            by_kind.setdefault(kind, {})[int(pk)] = topic
    for kind, ids in by_kind.items():
        model = apps.get_model(*_MODELS[kind])
        found |= {ids[pk] for pk in model.objects.filter(pk__in=list(ids)).values_list("pk", flat=True)}
    return found
