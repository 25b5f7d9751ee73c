"""Who a request came from, for throttles and lockouts: the connecting address, or, when that is a proxy the
admin listed (TRUSTED_PROXIES), the address that proxy says it forwarded for.

Behind a reverse proxy every request connects from the proxy: five bad logins for one user name locked that user
out for everyone, and twenty bad API tokens throttled every uncached token. X-Forwarded-For is read only from a
listed proxy (anyone else could write it), from its right end: the last address a trusted proxy did not add is the
client as the outermost trusted proxy saw it.
"""
import ipaddress

from django.conf import settings


def _trusted(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in _networks())


def _networks() -> list:
    return [ipaddress.ip_network(entry, strict=False) for entry in settings.TRUSTED_PROXIES]


def client_address(request) -> str:
    """The client's address (axes' AXES_CLIENT_IP_CALLABLE, the API token throttle)."""
    remote = request.META.get("REMOTE_ADDR", "") or ""
    if not settings.TRUSTED_PROXIES or not _trusted(remote):
        return remote
    hops = [h.strip() for h in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if h.strip()]
    for hop in reversed(hops):
        if not _trusted(hop):
            return hop
    return hops[0] if hops else remote
