"""One error shape for the whole API: {"error": {"code", "message", "fields", ...details}}."""
from dataclasses import asdict, is_dataclass

import orjson
from rest_framework import status
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from plumbing.errors import ServiceError
from plumbing.params import ParamError

# Service refusals that are about the state of things (busy, exists, no room) answer 409;
# the rest are bad input (400).
CONFLICT_CODES = {"busy", "exists", "in_use", "disk_full", "not_running", "not_failed", "gpus_busy", "port_in_use",
                  "foreign_processes", "not_paused", "confirm", "does_not_fit", "revoked", "incompatible",
                  "no_sleep_mode", "not_sleeping", "not_shared", "sleep_probe_failed",
                  "no_known_good", "secret_gone"}


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


class FastJSONRenderer(JSONRenderer):
    """DRF's JSON renderer with orjson doing the encoding (about ten times faster than the standard library's json
    on the node list's 200 KB of telemetry): the same compact UTF-8 text; what orjson does not know natively
    (and every datetime, so it keeps DRF's format) goes through DRF's own encoder. Indented output (a media type
    with `indent=`, the browsable API) stays with DRF."""

    _options = orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATETIME

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if data is None or self.get_indent(accepted_media_type, renderer_context or {}) is not None:
            return super().render(data, accepted_media_type, renderer_context)
        try:
            text = orjson.dumps(data, default=self.encoder_class().default, option=self._options)
        except orjson.JSONEncodeError:  # an integer past 64 bits, say: the standard library's way
            return super().render(data, accepted_media_type, renderer_context)
        if b"\xe2\x80\xa8" in text or b"\xe2\x80\xa9" in text:  # kept a strict JavaScript subset, as DRF does
            text = text.replace(b"\xe2\x80\xa8", b"\\u2028").replace(b"\xe2\x80\xa9", b"\\u2029")
        return text
