"""Periodic conditions from what the control plane keeps (heartbeats, the last telemetry sample) and the
benchmark and study ends, each told once, resolved once; and the Notifications page and API a user sets it up with."""
import datetime as dt
import re
import time

import pytest
from django.utils import timezone

from benchmarks.models import BenchmarkRun, Study
from deployments.models import Node
from deployments.notify import checks, services
from deployments.notify.models import Alert, Channel, Delivery, Subscription
from deployments.services import nodes
from tests.factories import BenchmarkPointFactory, BenchmarkRunFactory, NodeFactory, StudyFactory, UserFactory

pytestmark = pytest.mark.django_db


def _events(receiver) -> list[tuple[str, str]]:
    return [(r.json["event"], r.json["phase"]) for r in receiver.received]


def _sample(node: Node, gpus: list[dict]) -> None:
    """A telemetry sample through the path the agent's samples take (kept as the node's snapshot)."""
    full = [{"index": g["index"], "uuid": f"GPU-{g['index']}", "memory_total": 80 << 30, "memory_used": 1 << 30,
             "memory_free": 79 << 30, "util_gpu": 0, "util_memory": 0, "power_w": 60.0, "power_limit_w": 700.0,
             "sm_clock_mhz": 1000, "pcie_gen": 5, "pcie_width": 16, "processes": [], "temperature_c": 40,
             "ecc_sbe_volatile": 0, "ecc_dbe_volatile": 0, **g} for g in gpus]
    nodes.node_sample_record(node.pk, {"t": time.time(), "gpus": full, "nvml_error": "",
                                       "disk": {"total": node.disk_total, "free": node.disk_free, "used": 0},
                                       "host": {"ram_total": 1 << 36, "ram_available": 1 << 35, "load1": 0.1, "cpu_count": 8,
                                                "cpu_percent": 1.0, "net_rx_bps": 0, "net_tx_bps": 0}}, {})


def test_a_node_offline_then_back_is_one_message_and_one_resolve(subscriber, receiver, send_due):
    node = NodeFactory(heartbeat_seconds=5)
    checks.conditions_check()
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now() - dt.timedelta(seconds=60))
    checks.conditions_check()
    checks.conditions_check()
    send_due()
    assert _events(receiver) == [("node_offline", "firing")]
    assert receiver.received[0].json["node"]["name"] == node.name
    # The age is the check's own clock against the heartbeat set 60 s before it: 60 s, or more on a busy host.
    age = re.search(r"No heartbeat for (\d+) s", receiver.received[0].json["text"])
    assert age and 60 <= int(age.group(1)) < 600, receiver.received[0].json["text"]
    nodes.node_heartbeat(node.pk)
    checks.conditions_check()
    send_due()
    assert _events(receiver) == [("node_offline", "firing"), ("node_offline", "resolved")]


def test_a_node_that_never_reported_is_not_offline(subscriber, receiver, send_due):
    NodeFactory(last_heartbeat=None)
    checks.conditions_check()
    assert Alert.objects.count() == 0


def test_ecc_errors_and_a_hot_gpu_from_the_last_sample(subscriber, receiver, send_due):
    node = NodeFactory()
    _sample(node, [{"index": 0, "ecc_dbe_volatile": 2}, {"index": 1, "temperature_c": 91}])
    checks.conditions_check()
    checks.conditions_check()
    send_due()
    assert sorted(_events(receiver)) == [("gpu_ecc", "firing"), ("gpu_thermal", "firing")]
    by_kind = {r.json["event"]: r.json for r in receiver.received}
    assert "GPU 0: 2" in by_kind["gpu_ecc"]["text"] and "GPU 1: 91 °C" in by_kind["gpu_thermal"]["text"]
    _sample(node, [{"index": 0, "ecc_dbe_volatile": 0}, {"index": 1, "temperature_c": 82}])  # 82: within the 5 °C margin
    checks.conditions_check()
    send_due()
    assert ("gpu_thermal", "resolved") not in _events(receiver) and ("gpu_ecc", "resolved") in _events(receiver)


def test_a_finished_benchmark_tells_its_headline_figures(subscriber, receiver, send_due):
    run = BenchmarkRunFactory(status=BenchmarkRun.Status.RUNNING, single_stream_tok_s=41.5)
    BenchmarkPointFactory(run=run, concurrency=16, output_throughput=2345.0)
    BenchmarkPointFactory(run=run, concurrency=4, output_throughput=900.0)
    run.transition(BenchmarkRun.Status.DONE)
    run.save()
    send_due()
    [got] = receiver.received
    assert got.json["event"] == "benchmark_finished"
    assert got.json["text"] == "best 2,345 output tok/s at concurrency 16; one stream 41.5 tok/s."
    rates = BenchmarkRunFactory(status=BenchmarkRun.Status.RUNNING)
    BenchmarkPointFactory(run=rates, kind="rate", rate=4.0, concurrency=0, output_throughput=503.0)
    rates.transition(BenchmarkRun.Status.DONE)
    rates.save()
    send_due()
    assert receiver.received[-1].json["text"] == "best 503 output tok/s at 4 req/s."  # not "at concurrency 0"


def test_a_study_trials_benchmark_is_told_in_the_studys_message_and_each_message_links_to_its_run_or_study(
        subscriber, receiver, send_due, settings):
    # A 6-trial study sent 6 "benchmark finished" webhooks and then its own, each linking to the deployment's page.
    settings.PANEL_URL = "http://panel.example:8000"
    study = StudyFactory(status=Study.Status.RUNNING)
    trial = study.trials.first()
    trial.run = BenchmarkRunFactory(deployment=study.deployment, status=BenchmarkRun.Status.RUNNING)
    trial.save()
    trial.run.transition(BenchmarkRun.Status.DONE)
    trial.run.save()
    assert send_due() == []
    alone = BenchmarkRunFactory(status=BenchmarkRun.Status.RUNNING)
    alone.transition(BenchmarkRun.Status.DONE)
    alone.save()
    study.transition(Study.Status.FINISHING)
    study.transition(Study.Status.DONE)
    study.save()
    send_due()
    assert sorted((r.json["event"], r.json["url"]) for r in receiver.received) == [
        ("benchmark_finished", f"http://panel.example:8000/benchmarks/{alone.pk}/"),
        ("study_finished", f"http://panel.example:8000/benchmarks/studies/{study.pk}/")]


def test_a_finished_study_names_its_winner(subscriber, receiver, send_due):
    study = StudyFactory(status=Study.Status.FINISHING)
    variant = study.variants.exclude(is_baseline=True).first()
    study.results = {"winner": variant.pk, "winner_why": "12 % more tok/s at 16.",
                     "variants": [{"id": variant.pk, "name": variant.name}]}
    study.transition(Study.Status.DONE)
    study.save()
    send_due()
    [got] = receiver.received
    assert got.json["event"] == "study_finished" and got.json["text"] == f"Winner: {variant.name}. 12 % more tok/s at 16."


def test_the_page_adds_a_channel_subscribes_and_sends_a_test(client, receiver, send_due):
    admin = UserFactory(role="admin")
    client.force_login(admin)
    assert client.get("/notifications/").status_code == 200
    response = client.post("/notifications/channel-add/", {"kind": "webhook", "name": "hook", "target": receiver.url})
    assert response.status_code == 302
    page = client.get("/notifications/").content.decode()
    key = page.split('<code id="new-key">')[1].split("</code>")[0]
    assert len(key) >= 40 and receiver.url not in page  # the hook's URL is its credential: shown as scheme and host
    assert key not in client.get("/notifications/").content.decode()  # shown once
    channel = Channel.objects.get(user=admin)
    assert channel.target != receiver.url and channel.address == receiver.url  # sealed at rest
    client.post("/notifications/subscription-add/", {"kinds": ["ready", "crashed"]})
    assert Subscription.objects.get(user=admin).kinds == ["crashed", "ready"]
    client.post("/notifications/channel-test/", {"channel": channel.pk})
    assert send_due() == ["sent"] and receiver.received[0].json["phase"] == "test"
    assert "sent" in client.get("/notifications/").content.decode()


def test_a_viewer_may_add_an_e_mail_channel_but_not_a_webhook(client, viewer):
    client.force_login(viewer)
    assert client.post("/notifications/channel-add/", {"kind": "webhook", "name": "h", "target": "http://10.0.0.1/"}).status_code == 403
    client.post("/notifications/channel-add/", {"kind": "email", "name": "me", "target": "not an address"})
    assert not Channel.objects.exists()
    client.post("/notifications/channel-add/", {"kind": "email", "name": "me", "target": "me@example.com"})
    assert Channel.objects.get().target == "me@example.com"


def test_a_user_without_a_role_gets_no_page_and_no_api(client, db):
    nobody = UserFactory()
    client.force_login(nobody)
    assert client.get("/notifications/").status_code == 403
    assert client.get("/api/notify/channels/").status_code == 403
    with pytest.raises(services.NotifyError):
        services.subscription_add(nobody, ["ready"])


def test_the_api_sets_everything_up_and_shows_the_delivery_log(api, operator, receiver, send_due):
    created = api.post("/api/notify/channels/", {"kind": "email", "name": "me", "target": "op@example.com"}, format="json")
    assert created.status_code == 201 and created.json()["shown"] == "op@example.com" and "target" not in created.json()
    assert api.post("/api/notify/channels/", {"kind": "slack", "name": "s", "target": "https://hooks.slack.com/x"},
                    format="json").status_code == 403  # operators are not admins
    bad = api.post("/api/notify/subscriptions/", {"kinds": ["nonsense"]}, format="json")
    assert bad.status_code == 400
    sub = api.post("/api/notify/subscriptions/", {"kinds": ["disk_low"], "node": NodeFactory().pk}, format="json")
    assert sub.status_code == 201 and sub.json()["kinds"] == ["disk_low"]
    assert api.put("/api/notify/quiet/", {"start": "22:00", "end": "07:00", "tz": "Mars/Olympus"}, format="json").status_code == 400
    assert api.put("/api/notify/quiet/", {"start": "22:00", "end": "07:00", "tz": "Europe/Berlin"},
                   format="json").json() == {"start": "22:00:00", "end": "07:00:00", "tz": "Europe/Berlin"}
    channel = created.json()["id"]
    assert api.post(f"/api/notify/channels/{channel}/test/").status_code == 202
    log = api.get("/api/notify/deliveries/").json()
    assert [(d["phase"], d["status"], d["channel"]) for d in log] == [("test", "pending", channel)]
    assert api.delete(f"/api/notify/channels/{channel}/").status_code == 204
    assert not Delivery.objects.exists()
