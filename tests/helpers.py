"""Small helpers the test files share (the ones each file used to write for itself): an API client signed
in as a user, whether a PID is a live process, every URL pattern of the URLconf. Fixtures live in the conftest of
their folder; free_port, wait_until and in_thread stay in tests/conftest.py."""
import psutil
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient


def api_client(user=None) -> APIClient:
    """A DRF test client, authenticated as `user` when one is given."""
    client = APIClient()
    if user is not None:
        client.force_authenticate(user)
    return client


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie, which only waits to be reaped, is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def url_patterns(patterns=None, prefix: str = ""):
    """(regex, name) of every URL pattern of the URLconf (or of `patterns`), includes walked into, the regex
    whole from the root with its anchors dropped; a page added later is found without a test changing."""
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        regex = prefix + entry.pattern.regex.pattern.lstrip("^").rstrip("$").replace("\\Z", "")
        if isinstance(entry, URLResolver):
            yield from url_patterns(entry.url_patterns, regex)
        elif isinstance(entry, URLPattern):
            yield regex, entry.name
