"""Events told through the real code paths that write them (the node side's move/fail/crash, the heartbeat, the
periodic check), delivered to a real HTTP receiver and a real SMTP sink: each event exactly one message with the
right content and a valid signature; repeats folded; a resolve after a firing; nobody told what they may not see."""
import datetime as dt
import time

import pytest
from django.utils import timezone

from deployments.models import Deployment, ModelCopy, Node
from deployments.node import crashes, steps
from deployments.notify import checks, services
from deployments.notify.models import Attempt, Delivery
from deployments.services import nodes
from tests.factories import DeploymentFactory, ModelCopyFactory, NodeFactory, UserFactory
from tests.webhooks import signed

S = Deployment.Status
pytestmark = pytest.mark.django_db


_valid = signed


def _loading(**fields) -> Deployment:
    return DeploymentFactory(status=S.LOADING, started=timezone.now() - dt.timedelta(seconds=95), **fields)


def _ready(**fields) -> Deployment:
    d = _loading(**fields)
    steps.move(d, S.READY)
    return d


def test_a_finished_load_is_one_signed_message_with_its_load_time(subscriber, receiver, send_due):
    d = _loading()
    steps.move(d, S.READY)
    assert send_due() == ["sent"]
    [got] = receiver.received
    assert _valid(got, subscriber.key)
    body = got.json
    assert (body["event"], body["phase"], body["severity"]) == ("ready", "firing", "info")
    # The load time is the row's own (ready_at less started): about 95 s, and more by however long this host took
    # between making the row and moving it (2 s once, beside a full suite), so read from the row, not typed in.
    d.refresh_from_db()
    took = (d.ready_at - d.started).total_seconds()
    assert 95 <= took and body["data"]["load_seconds"] == pytest.approx(took)
    assert body["title"] == f"{d.name} is ready after {took:.0f} s" and body["deployment"] == {"id": d.pk, "name": d.name}
    assert got.headers["X-Panel-Delivery"] == str(Delivery.objects.get().pk)


def test_a_tampered_body_does_not_verify(subscriber, receiver, send_due):
    steps.move(_loading(), S.READY)
    send_due()
    [got] = receiver.received
    got.body = got.body.replace(b"ready", b"fine!")
    assert not _valid(got, subscriber.key)


def test_a_crash_is_one_message_with_the_reason(subscriber, receiver, send_due):
    d = _ready()
    send_due()
    crashes.deployment_crashed(d, "the engine exited with code -9")
    assert send_due() == ["sent"]
    assert [r.json["event"] for r in receiver.received] == ["ready", "crashed"]
    crash = receiver.received[1].json
    assert crash["severity"] == "error" and crash["title"] == f"{d.name} crashed"
    assert "the engine exited with code -9" in crash["text"] and _valid(receiver.received[1], subscriber.key)


def test_a_stalled_load_is_one_message(subscriber, receiver, send_due):
    d = _loading()
    steps.fail(d, "Stalled: neither the log nor GPU memory moved for 601 s (phase weights, 40 %).")
    assert send_due() == ["sent"]
    [got] = receiver.received
    assert got.json["event"] == "stalled" and "601 s" in got.json["text"] and _valid(got, subscriber.key)


def test_a_low_disk_is_one_message_however_often_it_is_seen_and_one_resolve(subscriber, receiver, send_due):
    node = NodeFactory()
    nodes.node_heartbeat(node.pk, disk_total=100 * 2**30, disk_free=3 * 2**30)
    for _ in range(3):
        checks.conditions_check()
    assert send_due() == ["sent"]
    [low] = receiver.received
    assert low.json["event"] == "disk_low" and low.json["node"]["name"] == node.name
    assert "3.0 GiB free of 100.0 GiB" in low.json["text"] and _valid(low, subscriber.key)
    nodes.node_heartbeat(node.pk, disk_total=100 * 2**30, disk_free=40 * 2**30)
    checks.conditions_check()
    assert send_due() == ["sent"]
    assert [(r.json["event"], r.json["phase"]) for r in receiver.received] == [("disk_low", "firing"), ("disk_low", "resolved")]


def test_a_restart_loop_is_one_grouped_message_then_one_resolve(subscriber, receiver, send_due, monkeypatch):
    d = _ready(auto_restart=True)
    send_due()
    receiver.received.clear()
    for restart in range(4):
        crashes.deployment_crashed(Deployment.objects.get(pk=d.pk), f"exit {restart}")
        d = Deployment.objects.get(pk=d.pk)
        assert d.status == S.QUEUED and d.restarts == restart + 1
        for status in (S.PREPARING, S.STARTING, S.LOADING, S.READY):
            steps.move(d, status)
        send_due()
    [fired] = receiver.received
    assert fired.json["event"] == "crashed" and fired.json["phase"] == "firing"
    monkeypatch.setenv("NOTIFY_STABLE_S", "0")
    # The node beats now: on a busy host the four restarts above took longer than a node may go without a heartbeat,
    # and the check rightly said "offline" too (a message of its own, not the one this test is about).
    Node.objects.filter(pk=d.node_id).update(last_heartbeat=timezone.now())
    checks.conditions_check()
    checks.conditions_check()
    assert send_due() == ["sent"]
    assert len(receiver.received) == 2
    resolved = receiver.received[1].json
    assert resolved["phase"] == "resolved" and resolved["event"] == "restart_loop" and resolved["severity"] == "critical"
    assert "after 4 automatic restart(s)" in resolved["text"] and "8 event(s)" in resolved["text"]


def test_a_receiver_down_gets_the_message_once_it_is_back(subscriber, receiver, send_due):
    receiver.stop()
    steps.move(_loading(), S.READY)
    assert send_due() == ["retry"]
    delivery = Delivery.objects.get()
    assert delivery.status == "pending" and delivery.attempts == 1 and "ConnectionRefusedError" in delivery.error
    time.sleep(0.25)
    receiver.answer = 503
    receiver.start()
    assert send_due() == ["retry"]
    time.sleep(0.45)
    receiver.answer = 200
    assert send_due() == ["sent"]
    assert [a.status_code for a in Attempt.objects.order_by("id")] == [None, 503, 200]
    assert len(receiver.received) == 2 and _valid(receiver.received[-1], subscriber.key)


def test_a_receiver_that_stays_down_is_marked_failing_after_its_retries(subscriber, receiver, send_due, monkeypatch):
    monkeypatch.setenv("NOTIFY_RETRY_BASE_S", "0")
    monkeypatch.setenv("NOTIFY_MAX_ATTEMPTS", "3")
    receiver.answer = 500
    steps.move(_loading(), S.READY)
    assert [send_due(), send_due(), send_due()] == [["retry"], ["retry"], ["failed"]]
    subscriber.hook.refresh_from_db()
    assert subscriber.hook.failing and "HTTP 500" in subscriber.hook.last_error
    assert send_due() == []


def test_a_gone_hook_fails_at_once(subscriber, receiver, send_due):
    receiver.answer = 404
    steps.move(_loading(), S.READY)
    assert send_due() == ["failed"]


def test_a_pending_delivery_whose_task_was_lost_is_sent_again_by_the_sweep(subscriber, sent_tasks):
    from deployments.notify import deliveries

    steps.move(_loading(), S.READY)  # its task went to a broker that lost it (a restart)
    sent_tasks.commit().clear()
    assert deliveries.deliveries_due() == 1
    assert [(s.name, s.args) for s in sent_tasks.commit()] == [("notify.deliver", [Delivery.objects.get().pk])]


def test_a_user_without_a_role_hears_nothing(subscriber, receiver, send_due):
    nobody = UserFactory()
    services.Subscription.objects.create(user=nobody, kinds=[])
    services.Channel.objects.create(user=nobody, kind="email", name="mine", target="nobody@example.com")
    steps.move(_loading(), S.READY)
    send_due()
    assert Delivery.objects.filter(channel__user=nobody).count() == 0
    assert Delivery.objects.filter(channel__user=subscriber).count() == 1


def test_a_subscription_to_one_deployment_hears_only_of_it(subscriber, receiver, send_due):
    services.Subscription.objects.filter(user=subscriber).delete()
    mine, other = _loading(), _loading()
    services.subscription_add(subscriber, ["ready", "crashed"], deployment_id=mine.pk)
    steps.move(other, S.READY)
    steps.move(mine, S.READY)
    send_due()
    assert [r.json["deployment"]["name"] for r in receiver.received] == [mine.name]


def test_a_download_finishing_and_an_e_mail_channel(db, smtp, send_due):
    user = UserFactory(role="viewer")
    services.channel_add(user, "email", "me", "viewer@example.com")
    services.subscription_add(user, ["download_finished"])
    copy = ModelCopyFactory(state=ModelCopy.State.DOWNLOADING, bytes_total=3 * 2**30)
    copy.transition(ModelCopy.State.READY)
    copy.save()
    assert send_due() == ["sent"]
    [(to, mail)] = smtp.messages
    assert to == ["viewer@example.com"]
    assert mail["Subject"] == f"[INFO] {copy.model} downloaded on {copy.node.name}"
    assert "3.0 GiB" in mail.get_payload()


def test_quiet_hours_hold_a_message_until_they_end_but_not_a_critical_one(subscriber):
    from deployments.notify.alerts import quiet_until

    services.quiet_hours_set(subscriber, dt.time(22, 0), dt.time(7, 0), "Europe/Berlin")
    subscriber.refresh_from_db()
    night = dt.datetime(2026, 12, 2, 23, 30, tzinfo=dt.timezone.utc)  # 00:30 in Berlin
    assert quiet_until(subscriber, night) == dt.datetime(2026, 12, 3, 6, 0, tzinfo=dt.timezone.utc)
    day = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.timezone.utc)
    assert quiet_until(subscriber, day) == day


def test_a_message_in_quiet_hours_waits_and_a_restart_loop_does_not(subscriber, receiver, send_due):
    now = timezone.localtime(timezone.now(), dt.timezone.utc)
    services.quiet_hours_set(subscriber, (now - dt.timedelta(hours=1)).time(), (now + dt.timedelta(hours=1)).time(), "UTC")
    steps.move(_loading(), S.READY)
    assert send_due() == ["not due"] and receiver.received == []


def test_the_test_button_sends_to_its_channel_only(subscriber, receiver, send_due):
    services.channel_test(subscriber, subscriber.hook.pk)
    assert send_due() == ["sent"]
    [got] = receiver.received
    assert got.json["phase"] == "test" and _valid(got, subscriber.key)


def test_a_team_subscription_reaches_each_member_on_their_own_channel_and_no_one_else(db, smtp, send_due):
    from django.contrib.auth.models import Group

    team = Group.objects.create(name="inference-oncall")
    alice, bob, outsider = UserFactory(role="viewer"), UserFactory(role="operator"), UserFactory(role="viewer")
    for user, address in ((alice, "alice@example.com"), (bob, "bob@example.com"), (outsider, "out@example.com")):
        services.channel_add(user, "email", "mail", address)
    alice.groups.add(team)
    bob.groups.add(team)
    with pytest.raises(services.NotifyError):
        services.subscription_add(outsider, ["crashed"], team_id=team.pk)  # not a member
    services.subscription_add(alice, ["crashed"], team_id=team.pk)
    d = _ready()
    crashes.deployment_crashed(d, "exit 1")
    assert send_due() == ["sent", "sent"]
    assert sorted(to[0] for to, _ in smtp.messages) == ["alice@example.com", "bob@example.com"]
    assert all(mail["Subject"] == f"[ERROR] {d.name} crashed" for _, mail in smtp.messages)


def test_a_studys_loads_and_failed_variants_are_told_once_when_it_finishes_not_one_message_each(subscriber, receiver,
                                                                                                  send_due):
    """A 6-trial study sent 7 "ready" webhooks in four minutes, each one linking nowhere ("url": "")."""
    from benchmarks.models import Study
    from tests.factories import StudyFactory

    d = _loading()
    study = StudyFactory(deployment=d)
    Study.objects.filter(pk=study.pk).update(status=Study.Status.RUNNING)
    steps.move(d, S.READY)  # a trial's redeploy
    steps.fail(Deployment.objects.get(pk=d.pk), "--max-num-seqs takes a whole number from 1 up, not 'oops'")
    assert send_due() == []
    Study.objects.filter(pk=study.pk).update(status=Study.Status.DONE)
    d = Deployment.objects.get(pk=d.pk)
    d.status = S.LOADING
    d.save()
    steps.move(d, S.READY)  # no study drives it now: told
    assert send_due() == ["sent"] and receiver.received[-1].json["event"] == "ready"


def test_a_message_links_to_its_deployment_or_node_on_the_panel(subscriber, receiver, send_due, settings):
    settings.PANEL_URL = "http://panel.example:8000/"
    d = _ready()
    node = NodeFactory()
    nodes.node_heartbeat(node.pk)
    send_due()
    assert receiver.received[0].json["url"] == f"http://panel.example:8000/deployments/{d.pk}/"
    from deployments.notify import alerts

    alerts.alert_raise("disk_low", node=node, title="disk low")
    send_due()
    assert receiver.received[-1].json["url"] == f"http://panel.example:8000/nodes/{node.pk}/"
