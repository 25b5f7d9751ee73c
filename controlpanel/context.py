from controlpanel.roles import is_operator


def roles(request):
    return {"is_operator": is_operator(getattr(request, "user", None)) if hasattr(request, "user") else False}
