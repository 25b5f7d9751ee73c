"""Which URLs a benchmark may target besides deployments: only those an admin allowed.

Why: the panel sends requests to the URL from inside the network (the control worker), so an open
URL field is a way to reach the cloud metadata service, Redis, PostgreSQL or any internal server.
BENCHMARK_URL_ALLOWLIST (set by whoever runs the panel) lists allowed URL prefixes, comma-separated,
e.g. "http://10.0.0.5:8000,https://llm.example.com/team-a"; the default allows none.
"""
from urllib.parse import urlsplit

from django.conf import settings

from plumbing.errors import ServiceError

_PORTS = {"http": 80, "https": 443}


def _parts(url: str):
    parts = urlsplit(url.strip())
    port = parts.port or _PORTS.get(parts.scheme)
    return parts.scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/")


def check(url: str) -> None:
    """Raise ServiceError unless `url` is a plain http(s) URL under an allowed prefix."""
    try:
        parts = urlsplit(url)
        scheme, host, port, path = _parts(url)
    except ValueError as exc:  # a port that is not a number
        raise ServiceError(f"Not a URL: {exc}", field="base_url") from exc
    if scheme not in _PORTS or not host or parts.username or parts.password or parts.query or parts.fragment \
            or "?" in url or "#" in url or "@" in parts.netloc or {".", ".."} & set(parts.path.split("/")):
        # "?x=" or "#" would turn the paths the panel appends (/v1/models) into a query of another URL.
        raise ServiceError("A benchmark URL is http(s)://host[:port][/path], without user, query, fragment or '..'.",
                           field="base_url")
    for allowed in settings.BENCHMARK_URL_ALLOWLIST:
        a_scheme, a_host, a_port, a_path = _parts(allowed)
        if (scheme, host, port) == (a_scheme, a_host, a_port) and (path == a_path or path.startswith(a_path + "/")):
            return
    raise ServiceError("This URL is not on the benchmark allowlist an admin set (BENCHMARK_URL_ALLOWLIST): "
                       "benchmark a deployment, or ask an admin to allow the server.", field="base_url", code="forbidden")
