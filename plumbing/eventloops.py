"""The event loop of a process that streams many sockets at once (the gateway, the runner's measuring processes,
the test servers): uvloop where installed, and every file descriptor the hard limit allows. Plain Python."""
import asyncio


def new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (about twice the chunks a second of asyncio's own loop), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def raise_fd_limit() -> None:
    """Lift the soft limit on open files to the hard one: each stream holds a socket (a proxied one two), and the
    default 1024 descriptors end a level or a gateway at a few hundred streams."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
