"""The TCP ports a process listens on, so a deploy onto a port a stranger's engine holds is refused naming
that port rather than as "other processes hold the GPUs". Plain Python, no Django."""
import psutil


def listening_ports(pid: int) -> list[int]:
    """The ports `pid` listens on; none when it is gone or its sockets cannot be read (another user's,
    without the rights)."""
    try:
        connections = psutil.Process(pid).net_connections(kind="inet")
    except psutil.Error:
        return []
    return sorted({c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN and c.laddr})


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
