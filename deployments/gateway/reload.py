"""Keeping a gateway's snapshot current: the change version in Redis every poll (0.25 s), the database's own
stamps every second (they catch a relaunch's new engine key, and everything when Redis is away), and a full
reload every RELOAD_S whatever they say. A reload reads everything in the database thread and swaps it in."""
import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from django.db import close_old_connections

from deployments.gateway import changes, config
from deployments.models import Node

log = logging.getLogger(__name__)

STAMPS_S = 1.0
RELOAD_S = 60.0
REDIS_TIMEOUT_S = 1.0


class Watcher:
    def __init__(self, gateway, poll_s: float = 0.25):
        self.gateway, self.poll_s = gateway, poll_s
        self.version = None
        self.stamps = None
        self.revoked_at = None  # the newest revoked_at seen
        self.loaded_at = 0.0
        self.stamped_at = 0.0
        self.port_reported = False
        self.redis_pool = ThreadPoolExecutor(1, thread_name_prefix="gateway-redis")
        self._task = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.redis_pool.shutdown(wait=False)

    async def reload(self) -> None:
        """Read everything now and serve from it."""
        stamps = await self.gateway.db(_stamps)
        snapshot = await self.gateway.db(config.load, self.gateway.node)
        self.gateway.install(snapshot)
        self.stamps, self.loaded_at = stamps, time.monotonic()
        self.revoked_at = stamps[0][2]
        if not self.port_reported and self.gateway.port:
            self.port_reported = await self.gateway.db(report_port, self.gateway.node, self.gateway.port)

    async def _version(self):
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(loop.run_in_executor(self.redis_pool, changes.version), REDIS_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - Redis away: the database stamps decide
            return None

    async def tick(self) -> bool:
        """One poll; True when it reloaded."""
        version = await self._version()
        due = version is None or time.monotonic() - self.stamped_at >= STAMPS_S
        stale = (version is not None and version != self.version) or time.monotonic() - self.loaded_at >= RELOAD_S
        if due and not stale:
            self.stamped_at = time.monotonic()
            stale = await self.gateway.db(_stamps) != self.stamps
        if not stale:
            return False
        digests, self.revoked_at = await self.gateway.db(config.revoked_since, self.revoked_at)
        self.gateway.revoke(digests)  # at once: the whole reload below takes longer with many keys
        await self.reload()
        if version is not None:
            self.version = version
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the database may be away: serve from what we have
                log.warning("Gateway reload failed (serving the last snapshot): %s", exc)
                await self.gateway.db(_reset_connection)


def _stamps():
    close_old_connections()
    return config.stamps()


def _reset_connection():
    from django.db import connection

    connection.close()


def report_port(node: str, port: int) -> bool:
    """Node.gateway_port = `port` (what callit, Prometheus discovery and other gateways use); False while the
    node has no row yet (its agent has not registered it)."""
    return bool(Node.objects.filter(name=node).update(gateway_port=port))
