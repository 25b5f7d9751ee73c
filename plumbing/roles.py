"""The roles: viewers watch, operators change things, admins also allow what runs code on a host.

Groups `viewer`, `operator` and `admin` (made by the migrations); superusers are admins. Each role includes the
ones before it.
"""
VIEWER = "viewer"
OPERATOR = "operator"
ADMIN = "admin"


def group_names(user) -> frozenset:
    """The user's group names, read once per user object (as Django caches permissions)."""
    names = getattr(user, "_panel_groups", None)
    if names is None:
        names = user._panel_groups = frozenset(user.groups.values_list("name", flat=True))
    return names


def is_admin(user) -> bool:
    """May allow privileged engine options (remote code, code- or file-loading flags) and benchmark URLs."""
    if user is None or not user.is_authenticated:
        return False
    return user.is_superuser or ADMIN in group_names(user)


def is_operator(user) -> bool:
    if user is None or not user.is_authenticated:
        return False
    return is_admin(user) or OPERATOR in group_names(user)


def is_viewer(user) -> bool:
    """Anyone allowed to look: viewers, operators and admins."""
    if user is None or not user.is_authenticated:
        return False
    return is_operator(user) or VIEWER in group_names(user)


def role_name(user) -> str:
    """The highest role, for the header: admin, operator, viewer or "no role"."""
    for check, name in ((is_admin, ADMIN), (is_operator, OPERATOR), (is_viewer, VIEWER)):
        if check(user):
            return name
    return "no role"


def operator_required(view):
    """Views that change things: viewers get 403 with a plain message."""
    from functools import wraps

    from django.http import HttpResponseForbidden

    @wraps(view)
    def wrapper(request, *args, **kwargs):
        if not is_operator(request.user):
            return HttpResponseForbidden("Changing things needs the operator role.")
        return view(request, *args, **kwargs)

    return wrapper
