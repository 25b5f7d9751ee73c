"""Small helpers the test files share (the ones each file used to write for itself): an API client signed
in as a user, whether a PID is a live process, a started process once it runs its own program, every URL pattern of
the URLconf. Fixtures live in the conftest of their folder; free_port, wait_until and in_thread stay in
tests/conftest.py."""
import subprocess
from pathlib import Path

import psutil
from django.urls import URLPattern, URLResolver, get_resolver
from rest_framework.test import APIClient

from deployments.host.ownership import MARKER_VAR
from tests.conftest import wait_until


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


def started(proc: subprocess.Popen, timeout: float = 10) -> subprocess.Popen:
    """`proc` once it has exec'd: its command line is its own argv. Popen returns as soon as the child's exec has
    begun, before the kernel has laid out the new program's arguments and environment, and /proc/<pid>/cmdline and
    environ read empty for that moment (189 of 2,000 reads right after Popen here, under load): a test that reads
    them at once races the process start."""
    argv = [str(a) for a in proc.args]

    def exec_done():
        try:
            return psutil.Process(proc.pid).cmdline() == argv
        except psutil.Error:
            return False

    wait_until(exec_done, timeout=timeout, interval=0.01, message=f"PID {proc.pid} to exec {argv[0]}")
    return proc


def marked(pid: int, marker: str, timeout: float = 10) -> int:
    """`pid` once /proc/<pid>/environ shows the engine marker `marker` (read here, not through the code under test):
    a process just launched, or just started by a unit, shows no environment until its exec is done (see `started`)."""
    def shown():
        try:
            return f"{MARKER_VAR}={marker}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False

    wait_until(shown, timeout=timeout, interval=0.01, message=f"PID {pid}'s marker")
    return pid


def url_patterns(patterns=None, prefix: str = ""):
    """(regex, name) of every URL pattern of the URLconf (or of `patterns`), includes walked into, the regex
    whole from the root with its anchors dropped; a page added later is found without a test changing."""
    for entry in get_resolver().url_patterns if patterns is None else patterns:
        regex = prefix + entry.pattern.regex.pattern.lstrip("^").rstrip("$").replace("\\Z", "")
        if isinstance(entry, URLResolver):
            yield from url_patterns(entry.url_patterns, regex)
        elif isinstance(entry, URLPattern):
            yield regex, entry.name
