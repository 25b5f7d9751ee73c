from plumbing.roles import is_admin, is_operator, role_name


def roles(request):
    user = getattr(request, "user", None)
    return {"is_operator": is_operator(user), "is_admin": is_admin(user), "role": role_name(user) if user else ""}
