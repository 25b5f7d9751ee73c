"""Integers a request carries (query filters, lists of ids, ids in a page's path), checked in one place
against what a database column holds.

SQLite raises OverflowError (a 500) for an integer beyond 2**63 - 1 where PostgreSQL answers cleanly,
so such a number is refused before the database sees it: 400 naming the parameter, 404 for a path id.
"""
from django.core.exceptions import BadRequest
from django.http import HttpResponseBadRequest

DB_INT_MAX = 2**63 - 1


class ParamError(BadRequest):
    """A query parameter that is not a whole number in range; the API answers 400 with its name."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name, self.message = name, message


def int_param(params, name: str, default: int | None = None, *, low: int = 0, high: int = DB_INT_MAX) -> int | None:
    """`params[name]` as an int within [low, high]; `default` when absent or empty."""
    raw = params.get(name, "")
    if raw in ("", None):
        return default
    return _checked(name, raw, low, high)


def ids_param(values, name: str, limit: int) -> list[int]:
    """Comma-separated or repeated ids (`?ids=1,2` or `?runs=1&runs=2`), at most `limit` of them."""
    parts = [part.strip() for value in values for part in str(value).split(",") if part.strip()]
    return [_checked(name, part, 1, DB_INT_MAX) for part in parts[:limit]]


def _checked(name: str, raw, low: int, high: int) -> int:
    text = str(raw).strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 19 or not low <= int(text) <= high:
        raise ParamError(name, f"must be a whole number from {low} to {high}.")
    return int(text)


class IdConverter:
    """`<id:pk>` in a page's path: digits within the database's range, else the page is not found."""

    regex = "[0-9]+"

    def to_python(self, value: str) -> int:
        number = int(value)
        if number > DB_INT_MAX:
            raise ValueError("beyond the database's integer range")  # Django's resolver: no match, 404
        return number

    def to_url(self, value) -> str:
        return str(value)


def bad_request(request, exception=None):
    """handler400: say what was wrong (our own ParamError text), not just "Bad Request"."""
    detail = str(exception) if isinstance(exception, ParamError) else "Bad request."
    return HttpResponseBadRequest(detail, content_type="text/plain; charset=utf-8")
