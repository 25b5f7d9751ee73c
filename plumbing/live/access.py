"""Who may keep a live WebSocket: the check the consumer runs on connect, on a timer and on a nudge, and the
signals that nudge.

A socket outlives the request that opened it, so logging out, losing the role or being deactivated must
reach sockets already open: logout closes that session's sockets, a role or account change makes the
user's sockets check again (publishing.end_session / recheck_user), and each socket re-checks on a timer
anyway (session expiry, changes made straight in the database). Which topics exist: plumbing.live.topics.
"""
from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_logged_out
from django.contrib.sessions.models import Session
from django.db import transaction
from django.db.models.signals import m2m_changed, post_save
from django.utils import timezone

from plumbing.live import publishing
from plumbing.roles import is_viewer


def close_code(user_id: int | None, session_key: str | None) -> int | None:
    """None while the socket may stay open; 4401 when the session ended, 4403 when the role went."""
    if session_key and not Session.objects.filter(session_key=session_key, expire_date__gt=timezone.now()).exists():
        return 4401
    user = get_user_model().objects.filter(pk=user_id, is_active=True).first() if user_id else None
    if user is None:
        return 4401
    return None if is_viewer(user) else 4403


def _logged_out(sender, request, user, **kwargs):
    key = getattr(getattr(request, "session", None), "session_key", None)
    if key:
        publishing.end_session(key)


def _groups_changed(sender, instance, action, reverse, pk_set, **kwargs):
    if action not in ("post_add", "post_remove", "post_clear"):
        return
    users = [instance.pk] if not reverse else list(pk_set or [])
    if reverse and action == "post_clear":
        users = []  # a group emptied: its former members' sockets notice on their timer
    for user_id in users:
        transaction.on_commit(lambda u=user_id: publishing.recheck_user(u))


def _user_saved(sender, instance, created, **kwargs):
    if not created:
        transaction.on_commit(lambda: publishing.recheck_user(instance.pk))


def connect_signals() -> None:
    """Called once per process (AppConfig.ready)."""
    user_model = get_user_model()
    user_logged_out.connect(_logged_out, dispatch_uid="live-logout")
    m2m_changed.connect(_groups_changed, sender=user_model.groups.through, dispatch_uid="live-groups")
    post_save.connect(_user_saved, sender=user_model, dispatch_uid="live-user")
