"""Fixtures for the gateway's tests: keys, deployments pointing at known-schedule servers, and the gateway itself
run in a thread of the test process (the e2e tests run it as its own process)."""
import asyncio
import secrets
import threading

import pytest

from deployments import sealed
from deployments.gateway import config, server
from deployments.gateway.models import CallerKey, Route
from deployments.models import Deployment
from tests.factories import DeploymentFactory, NodeFactory, UserFactory


def make_key(owner=None, **fields) -> str:
    """A caller key row with `fields`; returns its secret (as the account page shows it once)."""
    secret = "vcp-" + secrets.token_urlsafe(32)
    deployments = fields.pop("deployments", ())
    key = CallerKey.objects.create(owner=owner or UserFactory(), name=fields.pop("name", "k"), prefix=secret[:12],
                                   digest=config.digest(secret), **fields)
    key.deployments.set(deployments)
    return secret


def make_deployment(node, port, served="sched", aliases=(), status=Deployment.Status.READY, engine_key="",
                    **route):
    d = DeploymentFactory(node=node, port=port, status=status,
                          engine_args={"served-model-name": served, "max-num-seqs": 64},
                          engine_key=sealed.seal(engine_key) if engine_key else "")
    Route.objects.create(deployment=d, names=list(aliases), **route)
    return d


class GatewayThread:
    """A Gateway on its own event loop in a thread, on a free loopback port."""

    def __init__(self, node: str, **options):
        self.gateway = server.Gateway(node, **options)
        self.loop = asyncio.new_event_loop()
        self.runner = None
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)

    def __enter__(self):
        self._thread.start()
        self.runner = self.call(server.serve(self.gateway, "127.0.0.1", 0))
        return self

    def call(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def reload(self):
        self.call(self.gateway.watcher.reload())

    def __exit__(self, *exc):
        self.call(self.gateway.close())
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture
def node(transactional_db):
    return NodeFactory(name="gw-node", address="127.0.0.1")


@pytest.fixture
def sched():
    from tests.schedserver import SchedServer

    with SchedServer(ttft_ms=5, gap_ms=1, default_max_tokens=8, reasoning_tokens=3) as s:
        yield s


@pytest.fixture
def gateway(node):
    with GatewayThread(node.name, ready_wait_s=2.0, flush_s=0.2) as g:
        yield g
