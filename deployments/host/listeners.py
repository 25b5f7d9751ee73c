"""The TCP ports a process listens on, so a deploy onto a port a stranger's engine holds is refused naming
that port (issue 27) rather than as "other processes hold the GPUs". Plain Python, no Django."""
import psutil


def listening_ports(pid: int) -> list[int]:
    """The ports `pid` listens on; none when it is gone or its sockets cannot be read (another user's,
    without the rights)."""
    try:
        connections = psutil.Process(pid).net_connections(kind="inet")
    except psutil.Error:
        return []
    return sorted({c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN and c.laddr})
