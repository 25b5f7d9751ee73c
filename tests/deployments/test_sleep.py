"""Sleep, wake and swap as the control plane decides them (services/sleeps.py), the sleep level (node/sleep.py),
the API and panelctl's requests. The node's side against an engine is tests/faults/test_sleep_swap.py."""
from unittest import mock

import pytest

from deployments.gateway.models import Route
from deployments.models import Deployment, Node, SleepProbe
from deployments.node import sleep, sleepprobe
from deployments.services import deploys, sleepgate, sleeps
from panelctl import cli
from plumbing.errors import ServiceError
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.django_db
GIB = 1 << 30
S = Deployment.Status


def test_level_one_when_free_ram_holds_the_weights_with_a_margin_else_two():
    assert sleepprobe.choose_level(100 * GIB, 200 * GIB)[0] == 1
    level, why = sleepprobe.choose_level(547 * GIB, 400 * GIB)
    assert level == 2 and "547.0 GiB" in why and "400.0 GiB" in why
    need = int(100 * GIB * sleepprobe.RAM_MARGIN) + sleepprobe.RAM_SPARE
    assert sleepprobe.choose_level(100 * GIB, need)[0] == 1 and sleepprobe.choose_level(100 * GIB, need - 1)[0] == 2
    assert sleepprobe.choose_level(0, 500 * GIB)[0] == 2  # weights unknown: never assumed to fit


@pytest.fixture
def gpu_node():
    node = NodeFactory(name="g1", engine_version="0.32.0")
    for i in range(2):
        GpuFactory(node=node, index=i)
    return node


def _on(node, *indices, **fields):
    d = DeploymentFactory(node=node, model=ModelCopyFactory(node=node).model, **fields)
    d.gpus.set(node.gpus.filter(index__in=indices))
    return d


@pytest.fixture
def sent(sent_tasks):
    """The host tasks the services send (by name, with their arguments), caught before the broker."""
    return lambda: [(s.name, s.args) for s in sent_tasks.commit()]


def test_sleep_mode_is_refused_where_vllm_has_none():
    cpu = NodeFactory(engine_version="0.32.0+cpu")
    with pytest.raises(ServiceError, match="CPU build"):
        sleepgate.check_sleep_mode(cpu, 1, True, False, admin=True)
    with pytest.raises(ServiceError, match="one node"):
        sleepgate.check_sleep_mode(NodeFactory(engine_version="0.32.0"), 2, True, False, admin=True)
    with pytest.raises(ServiceError, match="needs sleep mode"):
        sleepgate.check_sleep_mode(cpu, 1, False, True)
    sleepgate.check_sleep_mode(cpu, 1, False, False)  # nothing asked: nothing refused


def test_a_sleep_mode_deploy_shares_gpus_with_sleep_mode_deployments_and_replaces_the_rest(gpu_node, sent):
    a = _on(gpu_node, 0, status=S.READY, sleep_mode=True)
    plain = _on(gpu_node, 1, status=S.READY)
    assert sleepgate.sharers(gpu_node, [0, 1], True) == {a.pk}  # the plan puts `a` to sleep; `plain` is stopped
    assert sleepgate.sharers(gpu_node, [0, 1], False) == set()  # without sleep mode both are replaced
    b = deploys.deployment_create(model=a.model, node=gpu_node, gpu_indices=[0], port=9100, engine_args={}, env={},
                                  name="b", sleep_mode=True, start_asleep=True, user=UserFactory(role="admin"))
    assert (b.sleep_mode, b.start_asleep, b.status) == (True, True, S.QUEUED)
    assert ("deployments.deployment_run", [b.pk]) in sent()
    assert plain.pk not in sleepgate.sharers(gpu_node, [1], True)


def test_where_engine_ports_answer_everyone_only_an_admin_turns_sleep_mode_on_and_an_operator_may_redeploy_it(
        gpu_node, sent):
    """Sleep mode means VLLM_SERVER_DEV_MODE=1: vLLM's development routes answer whoever reaches the port without a
    key. The node's doctor never proved its loopback door shut here (no engine_door check passed)."""
    operator, admin = UserFactory(role="operator"), UserFactory(role="admin")
    model = _on(gpu_node, 1, status=S.STOPPED).model
    with pytest.raises(ServiceError, match="Needs the admin role on g1: its engine ports answer every local user "
                                           r"\(see the node's engine_door check\).*VLLM_SERVER_DEV_MODE=1") as refused:
        deploys.deployment_create(model=model, node=gpu_node, gpu_indices=[0], port=9101, engine_args={}, env={},
                                  name="op", sleep_mode=True, user=operator)
    assert refused.value.code == "forbidden" and not Deployment.objects.filter(name="op").exists()
    plain = deploys.deployment_create(model=model, node=gpu_node, gpu_indices=[0], port=9101, engine_args={}, env={},
                                      name="op", user=operator)
    Deployment.objects.filter(pk=plain.pk).update(status=S.READY)
    plain.refresh_from_db()
    with pytest.raises(ServiceError, match="Needs the admin role on g1") as refused:  # nor on a redeploy
        deploys.deployment_redeploy(plain, sleep_mode=True, user=operator)
    assert refused.value.code == "forbidden" and not Deployment.objects.get(pk=plain.pk).sleep_mode
    plain.refresh_from_db()
    made = deploys.deployment_redeploy(plain, sleep_mode=True, user=admin)
    assert made.sleep_mode
    Deployment.objects.filter(pk=made.pk).update(status=S.READY)
    made.refresh_from_db()
    again = deploys.deployment_redeploy(made, user=operator)  # what an admin set up, redeployed as it is
    assert again.sleep_mode and again.status == S.QUEUED


def test_an_operator_turns_sleep_mode_on_where_the_nodes_doctor_proved_the_door_shut(gpu_node, sent):
    """The door (host/firewall.py) keeps every uid but the agent's off engine ports, dev routes included: the
    admin-only rule had no reason left there. A failed or missing engine_door check keeps it."""
    operator = UserFactory(role="operator")
    model = _on(gpu_node, 1, status=S.STOPPED).model
    for status in ("fail", "unknown"):
        Node.objects.filter(pk=gpu_node.pk).update(host_checks={"checks": [{"name": "engine_door", "status": status}]})
        gpu_node.refresh_from_db()
        with pytest.raises(ServiceError, match="Needs the admin role on g1"):
            deploys.deployment_create(model=model, node=gpu_node, gpu_indices=[0], port=9101, engine_args={}, env={},
                                      name="op", sleep_mode=True, user=operator)
    Node.objects.filter(pk=gpu_node.pk).update(host_checks={"checks": [{"name": "engine_door", "status": "pass"}]})
    gpu_node.refresh_from_db()
    made = deploys.deployment_create(model=model, node=gpu_node, gpu_indices=[0], port=9101, engine_args={}, env={},
                                     name="op", sleep_mode=True, user=operator)
    assert made.sleep_mode and made.status == S.QUEUED


def test_sleep_is_asked_of_the_node_only_for_a_ready_sleep_mode_deployment(gpu_node, sent):
    plain = _on(gpu_node, 0, status=S.READY)
    with pytest.raises(ServiceError, match="not started with sleep mode") as refused:
        sleeps.deployment_sleep(plain)
    assert refused.value.code == "no_sleep_mode"
    loading = _on(gpu_node, 1, status=S.LOADING, sleep_mode=True)
    with pytest.raises(ServiceError, match="only a ready deployment"):
        sleeps.deployment_sleep(loading)
    ready = _on(gpu_node, 1, status=S.READY, sleep_mode=True)
    with pytest.raises(ServiceError, match="level"):
        sleeps.deployment_sleep(ready, 3)
    sleeps.deployment_sleep(ready, 2)
    assert sent() == [("deployments.deployment_sleep", [ready.pk, 2])]
    assert ready.events.filter(step="sleep", message__contains="level 2").exists()


def test_a_wake_is_refused_naming_the_deployment_awake_on_its_gpus(gpu_node, sent):
    asleep = _on(gpu_node, 0, 1, status=S.SLEEPING, sleep_mode=True, sleep_level=1)
    awake = _on(gpu_node, 1, status=S.READY, sleep_mode=True, name="kimi")
    with pytest.raises(ServiceError, match="kimi \\(ready\\) holds") as refused:
        sleeps.deployment_wake(asleep)
    assert refused.value.code == "gpus_busy" and sent() == []
    Deployment.objects.filter(pk=awake.pk).update(status=S.SLEEPING)
    sleeps.deployment_wake(asleep)
    assert sent() == [("deployments.deployment_wake", [asleep.pk])]
    with pytest.raises(ServiceError) as refused:
        sleeps.deployment_wake(_on(gpu_node, 0, status=S.READY, sleep_mode=True))
    assert refused.value.code == "not_sleeping"


def test_a_swap_goes_to_the_node_or_redeploys_a_stopped_target(gpu_node, sent):
    a = _on(gpu_node, 0, status=S.READY, sleep_mode=True, name="minimax")
    b = _on(gpu_node, 0, status=S.SLEEPING, sleep_mode=True, name="kimi")
    elsewhere = _on(gpu_node, 1, status=S.SLEEPING, sleep_mode=True)
    with pytest.raises(ServiceError, match="do not share GPUs"):
        sleeps.deployment_swap(a, elsewhere)
    with pytest.raises(ServiceError, match="not started with sleep mode"):
        sleeps.deployment_swap(a, _on(gpu_node, 0, status=S.STOPPED))
    with pytest.raises(ServiceError, match="not serving"):
        sleeps.deployment_swap(b, a)
    assert sleeps.deployment_swap(a, b).pk == b.pk
    assert sent() == [("deployments.deployment_swap", [a.pk, b.pk])]
    Deployment.objects.filter(pk=b.pk).update(status=S.STOPPED)
    target = sleeps.deployment_swap(a, b)
    assert target.status == S.QUEUED and Deployment.objects.get(pk=b.pk).load_detail == {"swap_from": a.pk}
    assert sent()[-1] == ("deployments.deployment_run", [b.pk])


def test_the_names_callers_use_follow_the_swap():
    a, b = DeploymentFactory(), DeploymentFactory()
    Route.objects.create(deployment=a, names=["chat", "kimi"])
    Route.objects.create(deployment=b, names=["minimax"])
    assert sleep.move_aliases(a, b) == ["chat", "kimi"]
    assert Route.objects.get(deployment=b).names == ["minimax", "chat", "kimi"] and Route.objects.get(deployment=a).names == []
    assert sleep.move_aliases(a, b) == []


def test_the_api_puts_to_sleep_wakes_and_swaps(api, gpu_node, sent):
    a = _on(gpu_node, 0, status=S.READY, sleep_mode=True)
    b = _on(gpu_node, 0, status=S.SLEEPING, sleep_mode=True, sleep_level=1, sleep_ram_bytes=3 * GIB)
    shown = api.get(f"/api/deployments/{b.pk}/").json()
    assert (shown["status"], shown["sleep_level"], shown["sleep_ram_bytes"], shown["sleep_mode"]) == ("sleeping", 1, 3 * GIB, True)
    assert api.post(f"/api/deployments/{a.pk}/sleep/", {"level": 1}, format="json").status_code == 202
    refused = api.post(f"/api/deployments/{b.pk}/wake/", format="json")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "gpus_busy"
    swapped = api.post(f"/api/deployments/{a.pk}/swap/", {"to": b.pk}, format="json")
    assert swapped.status_code == 202 and swapped.json()["id"] == b.pk
    assert [name for name, _ in sent()] == ["deployments.deployment_sleep", "deployments.deployment_swap"]


def test_panelctl_asks_for_sleep_wake_and_swap(monkeypatch):
    asked = []

    class Panel:
        def __init__(self, *a):
            pass

        def get(self, path, **params):
            if path == "deployments/":
                return {"results": [{"id": 7 if params["name"] == "kimi" else 8}]}
            pk = int(path.split("/")[1])
            return {"id": pk, "name": {7: "kimi", 8: "minimax"}[pk], "status": "sleeping" if pk == 7 else "ready"}

        def post(self, path, body=None, key=None):
            asked.append((path, body))
            return {"id": 7, "name": "kimi", "status": "sleeping"}

    monkeypatch.setattr(cli, "Panel", Panel)
    assert cli.main(["--url", "http://x", "--token", "t", "swap", "minimax", "kimi"]) == 0
    assert cli.main(["--url", "http://x", "--token", "t", "sleep", "minimax", "--level", "2"]) == 0
    assert cli.main(["--url", "http://x", "--token", "t", "wake", "kimi"]) == 0
    assert asked == [("deployments/8/swap/", {"to": 7}), ("deployments/8/sleep/", {"level": 2}),
                     ("deployments/7/wake/", None)]
    args = cli.parser().parse_args(["deploy", "m", "--sleep-mode", "--start-asleep"])
    assert (args.sleep_mode, args.start_asleep) == (True, True)


def _proven(d, levels=(1, 2)):
    """A passed sleep probe of `d`'s combination for these levels (what the node's probe records)."""
    return SleepProbe.objects.create(node=d.node, model=d.model, deployment=d, key=SleepProbe.key_of(d),
                                     combination=SleepProbe.combination_of(d), verdict=SleepProbe.Verdict.PASSED,
                                     levels=[{"level": n, "tried": True, "passed": True} for n in levels])


def test_a_swap_whose_weights_do_not_fit_in_free_ram_sleeps_at_level_2(gpu_node, monkeypatch):
    source = _on(gpu_node, 0, status=S.READY, sleep_mode=True, name="kimi")
    source.model.total_size = 547 * GIB
    source.model.save()
    _proven(source)
    asked = []
    monkeypatch.setattr(sleep.vllm, "sleep", lambda url, level, key, timeout: asked.append(level))
    monkeypatch.setattr(sleep, "_key", lambda d: "k")
    monkeypatch.setattr(sleepprobe.psutil, "virtual_memory", lambda: mock.Mock(available=400 * GIB))
    said = sleep.put_to_sleep(Deployment.objects.select_related("model", "node").get(pk=source.pk))
    row = Deployment.objects.get(pk=source.pk)
    assert asked == [2] and row.status == S.SLEEPING and row.sleep_level == 2
    assert "level 2: 547.0 GiB of weights do not fit" in said and row.events.get(step="sleep").data["level"] == 2
    monkeypatch.setattr(sleepprobe.psutil, "virtual_memory", lambda: mock.Mock(available=1000 * GIB))
    Deployment.objects.filter(pk=source.pk).update(status=S.READY)
    sleep.put_to_sleep(Deployment.objects.select_related("model", "node").get(pk=source.pk))
    assert asked == [2, 1]


def test_a_sleep_mode_deployment_is_not_made_a_systemd_service(gpu_node):
    gpu_node.systemd = True
    gpu_node.save()
    d = _on(gpu_node, 0, status=S.READY, sleep_mode=True)
    with pytest.raises(ServiceError, match="cannot be made a systemd service") as refused:
        deploys.deployment_persist(d)
    assert refused.value.code == "no_sleep_mode" and not d.events.filter(step="persist").exists()


def test_the_status_moves_only_once_its_sleep_or_wake_step_has_ended(gpu_node, monkeypatch):
    """Whoever sees "sleeping" or "ready" finds the step that made it ended on the timeline (a swap's test read a
    woken deployment's timeline between the status and the step's end: ['sleep'] without its 'wake')."""
    d = _on(gpu_node, 0, status=S.READY, sleep_mode=True, name="kimi")
    _proven(d)
    monkeypatch.setattr(sleep.vllm, "sleep", lambda url, level, key, timeout: None)
    monkeypatch.setattr(sleep.vllm, "wake_up", lambda url, key, timeout, tags=(): None)
    monkeypatch.setattr(sleep.vllm, "is_sleeping", lambda url, key: False)
    monkeypatch.setattr(sleep, "_key", lambda d: "k")
    monkeypatch.setattr(sleepprobe, "key", lambda d: "k")
    monkeypatch.setattr(sleep, "wake_blockers", lambda d: [])  # this host's other engines are not its GPUs' holders
    seen = []
    moved = sleep.move

    def move(row, status, message):
        seen.append((status, list(row.events.filter(ended__isnull=True).values_list("step", flat=True))))
        return moved(row, status, message)

    monkeypatch.setattr(sleep, "move", move)
    sleep.put_to_sleep(Deployment.objects.select_related("model", "node").get(pk=d.pk), level=1)
    sleep.wake(Deployment.objects.select_related("model", "node").get(pk=d.pk))
    assert seen == [(S.SLEEPING, []), (S.READY, [])]
    assert list(d.events.filter(ended__isnull=False).values_list("step", flat=True)) == ["sleep", "wake"]
