"""One error shape for the whole API: {"error": {"code", "message", "fields"}}."""
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc, context):
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    data = response.data
    fields = {}
    if isinstance(data, dict) and "detail" in data and len(data) == 1:
        message = str(data["detail"])
    elif isinstance(data, dict):
        fields = {key: [str(m) for m in (value if isinstance(value, list) else [value])] for key, value in data.items()}
        message = "Invalid input." if fields else "Error."
    else:
        message = "; ".join(str(m) for m in data) if isinstance(data, list) else str(data)
    code = getattr(exc, "default_code", "error")
    if hasattr(exc, "get_codes"):
        codes = exc.get_codes()
        code = codes if isinstance(codes, str) else code
    response.data = {"error": {"code": code, "message": message, "fields": fields}}
    return response
