"""A deployment's energy hour by hour: the node agent's watch reads its GPUs' energy counters (the NVML double) beside
the engine's /metrics, splits idle from busy intervals, writes the hour's sums, and the API and /metrics give joules
per output token gross and net of the idle draw."""

import datetime as dt
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pynvml
import pytest
from django.db import DatabaseError
from django.test import Client

from deployments.host import gpu
from deployments.models import Deployment, DeploymentEnergy
from deployments.node import energyhours, watch
from deployments.node.energyhours import EnergyHours, Reading
from tests.deployments.test_deploys import model, node  # noqa: F401 - fixtures
from tests.factories import DeploymentFactory
from tests.helpers import api_client
from tests.nvmldouble import FakeGpu, FakeNvml

pytestmark = pytest.mark.django_db
S = Deployment.Status
HOUR = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)  # the API's windows end now


class _Engine(BaseHTTPRequestHandler):
    """vLLM's /metrics with the gauges the test sets."""

    running, waiting, generated = 0, 0, 100

    def log_message(self, *args):
        pass

    def do_GET(self):
        e = type(self)
        body = (f'vllm:num_requests_running{{engine="0"}} {e.running}.0\n'
                f'vllm:num_requests_waiting{{engine="0"}} {e.waiting}.0\n'
                f'vllm:generation_tokens_total{{engine="0"}} {e.generated}.0\n').encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield _Engine, server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def gpus(monkeypatch):
    fake = FakeNvml([FakeGpu(f"GPU-{i}") for i in range(8)])
    monkeypatch.setattr(gpu, "pynvml", fake)
    monkeypatch.setattr(gpu, "_session", None)
    return fake.gpus


def test_the_watch_splits_idle_from_busy_and_writes_the_hour_that_the_api_and_metrics_give(
        node, model, engine, gpus, monkeypatch, viewer):  # noqa: F811
    """Idle for 10 s (GPUs 0 and 1 draw 5 W each: 100 J), busy for 10 s (600 J, 600 tokens), then 41 s drawing
    nothing that began busy (so not idle): 700 J over 61 s, the idle draw 10 W, so 700 − 10 × 61 = 90 J net; per
    output token 1.1667 J gross, 0.15 J net. GPU 2, not the deployment's, draws too and counts for nothing."""
    state, port = engine
    d = DeploymentFactory(model=model, node=node, status=S.READY, pid=4242, pgid=4242, port=port)
    d.gpus.set(node.gpus.filter(index__in=[0, 1]))
    clock = SimpleNamespace(t=0.0)
    monkeypatch.setattr(energyhours, "time", SimpleNamespace(monotonic=lambda: clock.t))
    monkeypatch.setattr(watch, "timezone", SimpleNamespace(now=lambda: HOUR + dt.timedelta(minutes=5)))
    metrics = {}

    def reading(t, add_mj_each):
        clock.t = t
        for g in gpus[:3]:
            g.energy_mj += add_mj_each
        watch.deployments_metrics(node.pk, metrics)

    reading(0, 1_000_000)  # the first reading only starts the count
    reading(10, 50_000)
    state.running, state.generated = 2, 700
    reading(20, 300_000)
    assert not DeploymentEnergy.objects.exists()  # within the minute: still in the agent
    state.running = 0
    reading(61, 0)  # a minute since the first reading: written
    [row] = DeploymentEnergy.objects.all()
    assert (row.hour, row.joules, row.seconds, row.idle_joules, row.idle_seconds, row.output_tokens) == (
        HOUR, 700.0, 61.0, 100.0, 10.0, 600)

    answer = api_client(viewer).get(f"/api/deployments/{d.pk}/energy/?hours=2")
    assert answer.status_code == 200, answer.content
    got = answer.json()
    idle_w = 10.0
    assert got["joules"] == 700.0 and got["output_tokens"] == 600 and got["idle_watts"] == round(idle_w, 1)
    assert got["joules_net"] == round(700 - idle_w * 61, 1)
    assert got["joules_per_token"] == round(700 / 600, 4)
    assert got["joules_per_token_net"] == round((700 - idle_w * 61) / 600, 4)
    assert [h["hour"] for h in got["by_hour"]] == [HOUR.isoformat()]
    assert api_client(viewer).get(f"/api/deployments/{d.pk}/energy/?hours=0").status_code == 400

    browser = Client()
    browser.force_login(viewer)
    page = browser.get(f"/deployments/{d.pk}/").content.decode()
    assert "0.000 kWh · 12 W on average · 1.167 J per output token (0.150 net of idle)" in page

    text = api_client(viewer).get("/metrics").content.decode()
    line = next(x for x in text.splitlines() if x.startswith("panel_deployment_energy_joules_total{")
                and f'deployment="{d.name}"' in x)
    assert float(line.rsplit(" ", 1)[1]) == 700.0


def test_an_hour_that_ends_is_written_at_once_and_a_counter_that_went_back_counts_nothing(node, model):  # noqa: F811
    d = DeploymentFactory(model=model, node=node, status=S.READY)
    hours = EnergyHours()
    next_hour = HOUR + dt.timedelta(hours=1)
    hours.add(d.pk, Reading(0, 5_000, 10, False), HOUR)
    hours.add(d.pk, Reading(2, 9_000, 10, False), HOUR)  # 4 J idle
    assert not hours.due(HOUR, now=2)
    hours.add(d.pk, Reading(4, 1_000, 10, False), next_hour)  # the driver reloaded: no interval
    hours.add(d.pk, Reading(6, 3_000, 30, True), next_hour)  # 2 J busy, 20 tokens
    assert hours.due(next_hour, now=6)  # the hour before waits
    hours.flush(6)
    rows = {r.hour: (r.joules, r.idle_joules, r.seconds, r.output_tokens) for r in DeploymentEnergy.objects.all()}
    assert rows == {HOUR: (4.0, 4.0, 2.0, 0), next_hour: (2.0, 0.0, 2.0, 20)}
    hours.forget(set())  # stopped: its next reading starts afresh
    hours.add(d.pk, Reading(100, 50_000, 0, False), next_hour)
    assert not hours.pending


def test_what_could_not_be_written_waits_for_the_next_flush(node, model, monkeypatch):  # noqa: F811
    d = DeploymentFactory(model=model, node=node, status=S.READY)
    hours = EnergyHours()
    hours.add(d.pk, Reading(0, 0, 0, False), HOUR)
    hours.add(d.pk, Reading(2, 4_000, 0, False), HOUR)
    real = DeploymentEnergy.objects.get_or_create

    def away(**kw):
        raise DatabaseError("the database is away")

    monkeypatch.setattr(DeploymentEnergy.objects, "get_or_create", away)
    with pytest.raises(DatabaseError):
        hours.flush(2)
    hours.add(d.pk, Reading(4, 10_000, 5, True), HOUR)
    monkeypatch.setattr(DeploymentEnergy.objects, "get_or_create", real)
    hours.flush(4)
    row = DeploymentEnergy.objects.get(deployment=d)
    assert (row.joules, row.idle_joules, row.seconds, row.idle_seconds, row.output_tokens) == (10.0, 4.0, 4.0, 2.0, 5)
    hours.flush(6)  # nothing pending: nothing added twice
    assert DeploymentEnergy.objects.get(deployment=d).joules == 10.0


def test_a_reading_of_gpus_the_node_no_longer_has_or_no_counters_is_none(gpus):
    assert energyhours.read([0, 1], {"num_requests_running": 0, "num_requests_waiting": 0}).busy is False
    assert energyhours.read([0, 9], {}) is None  # eight GPUs now
    assert energyhours.read([], {}) is None  # a CPU engine
    gpus[1].fails["nvmlDeviceGetTotalEnergyConsumption"] = pynvml.NVMLError_NotSupported
    assert energyhours.read([0, 1], {}) is None  # a GPU before Volta: no counter
