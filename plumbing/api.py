"""One error shape for the whole API: {"error": {"code", "message", "fields", ...details}}."""
from dataclasses import asdict, is_dataclass

from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from plumbing.errors import ServiceError
from plumbing.params import ParamError

# Service refusals that are about the state of things (busy, exists, no room) answer 409;
# the rest are bad input (400).
CONFLICT_CODES = {"busy", "exists", "in_use", "disk_full", "not_running", "not_failed", "gpus_busy", "port_in_use",
                  "foreign_processes", "not_paused", "confirm", "does_not_fit", "revoked", "incompatible",
                  "no_sleep_mode", "not_sleeping", "not_shared"}


def exception_handler(exc, context):
    if isinstance(exc, ParamError):
        return Response({"error": {"code": "invalid", "message": str(exc), "fields": {exc.name: [exc.message]}}},
                        status=status.HTTP_400_BAD_REQUEST)

    if isinstance(exc, ServiceError):
        details = {}
        if is_dataclass(exc):
            details = {k: v for k, v in asdict(exc).items() if k not in ("message", "field", "code")}
        code = status.HTTP_409_CONFLICT if exc.code in CONFLICT_CODES else status.HTTP_400_BAD_REQUEST
        if exc.code == "forbidden":  # allowed to the admin role only (deployments/privileged.py)
            code = status.HTTP_403_FORBIDDEN
        fields = {exc.field: [exc.message]} if exc.field else {}
        return Response({"error": {"code": exc.code, "message": exc.message, "fields": fields, **details}}, status=code)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    data = response.data
    fields = {}
    if isinstance(data, dict) and "detail" in data and len(data) == 1:
        message = str(data["detail"])
    elif isinstance(data, dict):
        fields = {key: _messages(value) for key, value in data.items()}
        message = "Invalid input." if fields else "Error."
    else:
        message = "; ".join(str(m) for m in data) if isinstance(data, list) else str(data)
    code = getattr(exc, "default_code", "error")
    if hasattr(exc, "get_codes"):
        codes = exc.get_codes()
        code = codes if isinstance(codes, str) else code
    response.data = {"error": {"code": code, "message": message, "fields": fields}}
    return response


def _messages(value, path: str = "") -> list[str]:
    """Plain messages of one field; a nested one (a list of objects: "workers") says where: "0.node: …"."""
    if isinstance(value, dict):
        return [m for key, inner in value.items() for m in _messages(inner, f"{path}{key}.")]
    if isinstance(value, list):
        return [m for inner in value for m in _messages(inner, path)]
    return [f"{path[:-1]}: {value}" if path else str(value)]
