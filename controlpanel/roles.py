"""The two roles: viewers watch, operators change things. Superusers are operators."""
VIEWER = "viewer"
OPERATOR = "operator"


def group_names(user) -> frozenset:
    """The user's group names, read once per user object (as Django caches permissions)."""
    names = getattr(user, "_panel_groups", None)
    if names is None:
        names = user._panel_groups = frozenset(user.groups.values_list("name", flat=True))
    return names


def is_operator(user) -> bool:
    if not user.is_authenticated:
        return False
    return user.is_superuser or OPERATOR in group_names(user)


def is_viewer(user) -> bool:
    """Anyone allowed to look: viewers and operators."""
    if not user.is_authenticated:
        return False
    return is_operator(user) or VIEWER in group_names(user)


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
