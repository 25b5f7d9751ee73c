"""Who listens on which TCP port of this host: a deploy onto a port some program holds is refused naming it, before
anything is stopped. Plain Python, no Django."""
import time

import psutil


_READ: tuple[float, dict[int, set[int]]] = (-1e9, {})
READ_EVERY_S = 2.0  # agents of one process (tests/fleetsim.py's simulated fleet) share one read of the host


def host_listeners() -> dict[int, set[int]]:
    """{port: the PIDs listening on it, on any address} for every listening TCP socket of the host; a socket whose
    PID cannot be read (another user's, to an agent that is not root) is there with no PID. Read at most every
    READ_EVERY_S in a process: it walks every process's sockets.

    psutil reads every process's sockets first and the socket tables after: a program that binds in between (an
    engine starting) is listed with no PID. Such a socket is read once more, where its process now shows."""
    global _READ
    if time.monotonic() - _READ[0] < READ_EVERY_S:
        return _READ[1]
    found = _read()
    if any(not pids for pids in found.values()):
        for port, pids in _read().items():
            if port in found:
                found[port] |= pids
    _READ = (time.monotonic(), found)
    return found


def _read() -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return {}
    for c in connections:
        if c.status == psutil.CONN_LISTEN and c.laddr:
            found.setdefault(c.laddr.port, set()).update([c.pid] if c.pid else [])
    return found


def listening(port: int) -> tuple[set[int], bool]:
    """(the PIDs listening on TCP `port` on any address, whether a listener's PID could not be read): a socket of
    another user's process shows no PID to an agent that is not root."""
    pids, hidden = set(), False
    try:
        connections = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return set(), True
    for c in connections:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid is None:
                hidden = True
            else:
                pids.add(c.pid)
    return pids, hidden
