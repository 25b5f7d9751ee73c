"""The two roles: viewers watch, operators change things. Superusers are operators."""
VIEWER = "viewer"
OPERATOR = "operator"


def is_operator(user) -> bool:
    if not user.is_authenticated:
        return False
    return user.is_superuser or user.groups.filter(name=OPERATOR).exists()


def is_viewer(user) -> bool:
    """Anyone allowed to look: viewers and operators."""
    if not user.is_authenticated:
        return False
    return is_operator(user) or user.groups.filter(name=VIEWER).exists()
