"""Service-level objectives: a deployment's engine figures over the last 5 minutes (as the agent keeps them,
read from the engine's own /metrics) checked by the periodic pass: a breach told once after it has lasted its
minutes, resolved once when met again; stale figures change nothing; operators set objectives, viewers read them."""
import datetime as dt
import time

import pytest
from django.utils import timezone

from deployments import payloads
from deployments.models import Deployment
from deployments.node import watch
from deployments.host import slo
from deployments.notify import checks, services
from deployments.notify.models import Alert, Slo
from plumbing.live import snapshots
from tests.factories import DeploymentFactory, UserFactory

pytestmark = pytest.mark.django_db
INF = float("inf")


def _figures(d, ttft_p95_s=None, error_share=None, requests=100, age_s=0.0, refused=0):
    """The engine figures as the agent's watch sends and keeps them."""
    payloads.send_engine_figures(d.node_id, payloads.EngineFigures(
        id=d.pk, name=d.name, tok_s=50.0, running=1.0, waiting=0.0, kv_cache=0.1, ttft_p95_s=ttft_p95_s,
        error_share=error_share, window_requests=requests, window_s=300.0, at=time.time() - age_s, refused=refused))


def _events(receiver):
    return [(r.json["event"], r.json["phase"]) for r in receiver.received]


def _breach_began(d, minutes_ago: float) -> None:
    Slo.objects.filter(deployment=d).update(breach_since=timezone.now() - dt.timedelta(minutes=minutes_ago))


def test_requests_the_engine_refused_for_load_are_an_objective_of_their_own(subscriber, receiver, send_due):
    """vLLM's admission caps refuse requests past its queue: they are kept out of the error share (not failures of
    the engine) and have their own objective, the share of the window's requests refused."""
    d = DeploymentFactory(status="ready")
    services.slo_set(subscriber, d.pk, ttft_p95_ms=None, error_pct=1, minutes=0, refused_pct=5)
    _figures(d, error_share=0.0, requests=95, refused=3)  # 3 of 98: 3.1 %
    checks.conditions_check()
    assert Slo.objects.get(deployment=d).breach_since is None
    _figures(d, error_share=0.0, requests=90, refused=10)
    checks.conditions_check()
    send_due()
    assert _events(receiver) == [("slo_breached", "firing")]
    assert receiver.received[0].json["title"] == (f"{d.name} breaks its SLO: 10.0 % of requests refused for load: 10 by "
                                                  "the engine's admission caps (objective 5 %)")
    with pytest.raises(services.NotifyError, match="refused-for-load objective is a percentage"):
        services.slo_set(subscriber, d.pk, ttft_p95_ms=None, error_pct=None, refused_pct=100)


def test_a_breach_is_told_once_after_its_minutes_and_resolved_once(subscriber, receiver, send_due):
    d = DeploymentFactory(status="ready")
    services.slo_set(subscriber, d.pk, ttft_p95_ms=2000, error_pct=None, minutes=5)
    _figures(d, ttft_p95_s=3.5)
    checks.conditions_check()  # the breach begins: not told yet
    assert Slo.objects.get(deployment=d).breach_since is not None and not Alert.objects.exists()
    _breach_began(d, 4)
    checks.conditions_check()
    assert not Alert.objects.exists()  # 4 of its 5 minutes
    _breach_began(d, 6)
    checks.conditions_check()
    checks.conditions_check()  # seen again while firing: nothing new
    send_due()
    assert _events(receiver) == [("slo_breached", "firing")]
    told = receiver.received[0].json
    assert told["title"] == f"{d.name} breaks its SLO: TTFT p95 3,500 ms (objective 2,000 ms)"
    assert told["severity"] == "warning" and told["data"]["ttft_p95_s"] == 3.5
    _figures(d, ttft_p95_s=0.8)
    checks.conditions_check()
    send_due()
    assert _events(receiver) == [("slo_breached", "firing"), ("slo_breached", "resolved")]
    assert Slo.objects.get(deployment=d).breach_since is None


def test_a_short_breach_is_forgotten_when_met_again(subscriber, receiver, send_due):
    d = DeploymentFactory(status="ready")
    services.slo_set(subscriber, d.pk, ttft_p95_ms=None, error_pct=5.0, minutes=5)
    _figures(d, error_share=0.2)
    checks.conditions_check()
    _figures(d, error_share=0.01)
    checks.conditions_check()
    _breach_began(d, 0)
    _figures(d, error_share=0.2)
    checks.conditions_check()  # a new breach, its clock from now
    send_due()
    assert receiver.received == [] and not Alert.objects.exists()


def test_an_error_rate_breach_with_zero_minutes_is_told_at_the_first_check(subscriber, receiver, send_due):
    d = DeploymentFactory(status="ready")
    services.slo_set(subscriber, d.pk, ttft_p95_ms=2000, error_pct=1.0, minutes=0)
    _figures(d, ttft_p95_s=0.5, error_share=0.25, requests=40)
    checks.conditions_check()
    send_due()
    [told] = receiver.received
    assert told.json["title"] == f"{d.name} breaks its SLO: 25.0 % of requests aborted or failed (objective 1 %)"
    assert "40 requests" in told.json["text"]


def test_stale_or_missing_figures_neither_fire_nor_resolve(subscriber, receiver, send_due):
    d = DeploymentFactory(status="ready")
    services.slo_set(subscriber, d.pk, ttft_p95_ms=100, error_pct=None, minutes=0)
    checks.conditions_check()  # no figures kept at all
    _figures(d, ttft_p95_s=9.0, age_s=checks.FRESH_S + 30)
    checks.conditions_check()
    assert not Alert.objects.exists()
    _figures(d, ttft_p95_s=9.0)
    checks.conditions_check()
    _figures(d, ttft_p95_s=0.01, age_s=checks.FRESH_S + 30)  # old news of a good minute: still firing
    checks.conditions_check()
    assert Alert.objects.get().resolved is None
    _figures(d, ttft_p95_s=None, error_share=None, requests=0)  # no request finished in the window: nothing breaks
    checks.conditions_check()
    assert Alert.objects.get().resolved is not None


def test_a_deployment_that_stops_serving_resolves_its_breach(subscriber, receiver, send_due):
    d = DeploymentFactory(status="ready")
    services.slo_set(subscriber, d.pk, ttft_p95_ms=100, error_pct=None, minutes=0)
    _figures(d, ttft_p95_s=9.0)
    checks.conditions_check()
    Deployment.objects.filter(pk=d.pk).update(status="stopped")
    checks.conditions_check()
    send_due()
    assert _events(receiver) == [("slo_breached", "firing"), ("slo_breached", "resolved")]
    assert "no longer serving (stopped)" in receiver.received[1].json["text"]


def test_the_agents_watch_keeps_the_window_figures_the_check_reads(monkeypatch):
    d = DeploymentFactory(status="ready", pid=12345)
    readings = iter([
        ({"generation_tokens_total": 10.0}, slo.Counters(((0.5, 10.0), (INF, 10.0)), {"stop": 10.0}, refused=1.0)),
        ({"generation_tokens_total": 30.0}, slo.Counters(((0.5, 12.0), (INF, 20.0)), {"stop": 18.0, "error": 2.0},
                                                         refused=4.0)),
    ])
    monkeypatch.setattr(watch.vllm, "read_engine", lambda url, timeout: next(readings))
    state = {}
    watch.deployments_metrics(d.node_id, state)
    watch.deployments_metrics(d.node_id, state)
    [kept] = snapshots.kept([payloads.deployment_topic(d.pk)], "engine")
    assert kept["window_requests"] == 10 and kept["error_share"] == pytest.approx(0.2)
    assert kept["refused"] == 3, "refused for load in the window: on the deployment page, apart from the errors"
    assert kept["ttft_p95_s"] == 0.5  # 8 of 10 new first tokens after 0.5 s: p95 is in +Inf, the highest bound
    assert time.time() - kept["at"] < 5


def test_operators_set_objectives_viewers_read_them(api, operator, viewer):
    d = DeploymentFactory(status="ready")
    url = f"/api/notify/slos/{d.pk}/"
    put = api.put(url, {"ttft_p95_ms": 1500, "error_pct": 2.5, "refused_pct": 4, "minutes": 10}, format="json")
    assert put.status_code == 200, put.content
    assert put.json() == {"deployment": d.pk, "ttft_p95_ms": 1500, "error_pct": 2.5, "refused_pct": 4.0, "minutes": 10,
                          "breach_since": None}
    assert api.put(url, {"minutes": 3}, format="json").status_code == 400  # no objective at all
    assert api.put(url, {"ttft_p95_ms": 0}, format="json").status_code == 400
    assert api.put("/api/notify/slos/999999/", {"ttft_p95_ms": 10}, format="json").status_code == 404
    api.force_authenticate(viewer)
    assert api.get("/api/notify/slos/").json()[0]["ttft_p95_ms"] == 1500
    assert api.put(url, {"ttft_p95_ms": 9}, format="json").status_code == 403
    assert api.delete(url).status_code == 403
    api.force_authenticate(operator)
    assert api.delete(url).status_code == 204 and not Slo.objects.exists()
    assert api.delete(url).status_code == 404


def test_the_page_sets_and_removes_objectives(client, operator):
    d = DeploymentFactory(status="ready", name="chat-prod")
    client.force_login(operator)
    page = client.post("/notifications/slo-set/", {"deployment": d.pk, "ttft_p95_ms": "2000", "error_pct": "",
                                                    "minutes": "5"}, follow=True)
    assert "Objectives of chat-prod saved." in page.content.decode()
    assert Slo.objects.get(deployment=d).ttft_p95_ms == 2000 and Slo.objects.get().error_pct is None
    assert "2000 ms" in client.get("/notifications/").content.decode()
    bad = client.post("/notifications/slo-set/", {"deployment": d.pk, "ttft_p95_ms": "fast"}, follow=True)
    assert "&#x27;fast&#x27; is not a whole number." in bad.content.decode()
    client.post("/notifications/slo-remove/", {"deployment": d.pk})
    assert not Slo.objects.exists()
    viewer = UserFactory(role="viewer")
    client.force_login(viewer)
    assert client.post("/notifications/slo-set/", {"deployment": d.pk, "ttft_p95_ms": "5"}).status_code == 403
