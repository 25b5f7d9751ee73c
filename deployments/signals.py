"""Open WebSockets follow the account: logout closes that session's sockets, a role or account
change makes the user's sockets check again (deployments/wsaccess.py)."""
from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_logged_out
from django.db import transaction
from django.db.models.signals import m2m_changed, post_save

from deployments import live


def _logged_out(sender, request, user, **kwargs):
    key = getattr(getattr(request, "session", None), "session_key", None)
    if key:
        live.end_session(key)


def _groups_changed(sender, instance, action, reverse, pk_set, **kwargs):
    if action not in ("post_add", "post_remove", "post_clear"):
        return
    users = [instance.pk] if not reverse else list(pk_set or [])
    if reverse and action == "post_clear":
        users = []  # a group emptied: its former members' sockets notice on their timer
    for user_id in users:
        transaction.on_commit(lambda u=user_id: live.recheck_user(u))


def _user_saved(sender, instance, created, **kwargs):
    if not created:
        transaction.on_commit(lambda: live.recheck_user(instance.pk))


def connect() -> None:
    user_model = get_user_model()
    user_logged_out.connect(_logged_out, dispatch_uid="live-logout")
    m2m_changed.connect(_groups_changed, sender=user_model.groups.through, dispatch_uid="live-groups")
    post_save.connect(_user_saved, sender=user_model, dispatch_uid="live-user")
