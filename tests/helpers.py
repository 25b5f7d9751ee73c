"""Small helpers the test files share (the ones each file used to write for itself): an API client signed
in as a user, whether a PID is a live process. Fixtures live in the conftest of their folder; free_port,
wait_until and in_thread stay in tests/conftest.py."""
import psutil
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
