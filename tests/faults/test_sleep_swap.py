"""Sleep mode on a real node agent, against the fake engine speaking vLLM's sleep endpoints (the routes, the
dev-mode switch, weights uninitialised after a level 2 wake until reload_weights): a deployment started asleep
beside a serving one, a swap between them with the gateway's names following, a wake refused while the other
serves, a level 2 round trip, and an agent SIGKILLed in the middle of a swap, after which every row says what its
engine is (asleep or serving) and never are both serving. The GPU side (memory released and taken again, seen by
NVML) is tests/gpu/test_sleep_gpu.py."""
import json
import time

import httpx
import pytest

from django.test import Client

from deployments import engineapikey
from deployments.gateway.models import Route
from deployments.host import vllm
from deployments.models import Deployment
from deployments.services import sleeps
from plumbing.errors import ServiceError
from tests.conftest import wait_until
from tests.factories import UserFactory
from tests.truestate import (COUNTS, add_fake_model, deploy, engines_under, orphans, random_moment, settle,
                             stop_and_check)

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
SLEEP_S = WAKE_S = 1.0  # the fake engine's sleep and wake (a window for the agent kill)


def _model(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    (folder / "fake_engine.json").write_text(json.dumps({"load_s": 1.0, "sleep_s": SLEEP_S, "wake_s": WAKE_S,
                                                         "weights_mb": 32}))
    return folder


def _engine_asleep(d) -> bool:
    d = Deployment.objects.get(pk=d.pk)
    return vllm.is_sleeping(f"http://127.0.0.1:{d.port}", key=engineapikey.of(d))


def _answer(d) -> str:
    d = Deployment.objects.get(pk=d.pk)
    reply = httpx.post(f"http://127.0.0.1:{d.port}/v1/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {engineapikey.of(d)}"},
                       json={"model": "x", "messages": [{"role": "user", "content": "capital of France?"}]})
    return reply.json()["choices"][0]["message"]["content"]


def _status(d) -> str:
    return Deployment.objects.get(pk=d.pk).status


def test_a_swap_pair_starts_asleep_swaps_wakes_and_keeps_its_true_state_through_an_agent_kill(
        fault_agent, tmp_path, unique):
    node = fault_agent.node
    folders = {"a": _model(tmp_path, "model-a"), "b": _model(tmp_path, "model-b")}
    admin = UserFactory(role="admin")  # sleep mode opens vLLM's development routes: an admin's call
    a = deploy(add_fake_model(node, folders["a"]), node, name=f"a-{unique}", sleep_mode=True, user=admin)
    assert settle(a, states={"ready", "failed"}).status == "ready"
    Route.objects.create(deployment=a, names=[f"chat-{unique}"])

    # B deployed "asleep" on the same host: A sleeps while B loads, B goes to sleep once smoke-tested, A wakes.
    b = deploy(add_fake_model(node, folders["b"]), node, name=f"b-{unique}", sleep_mode=True, start_asleep=True,
               user=admin)
    assert settle(b, timeout=90, states={"sleeping", "failed"}).status == "sleeping", Deployment.objects.get(pk=b.pk).status_message
    wait_until(lambda: _status(a) == "ready", timeout=30, message="A awake again after B went to sleep")
    assert _engine_asleep(b) and not _engine_asleep(a)
    b_steps = list(Deployment.objects.get(pk=b.pk).events.values_list("step", flat=True))
    assert b_steps.index("sleep_others") < b_steps.index("launch") < b_steps.index("smoke_test") < b_steps.index("sleep")
    a_steps = [e.step for e in Deployment.objects.get(pk=a.pk).events.filter(step__in=("sleep", "wake"), ended__isnull=False)]
    assert a_steps[-2:] == ["sleep", "wake"]
    assert Deployment.objects.get(pk=b.pk).sleep_level == 1 and Deployment.objects.get(pk=b.pk).sleep_ram_bytes > 0
    with pytest.raises(ServiceError, match="holds"):
        sleeps.deployment_wake(Deployment.objects.get(pk=b.pk))  # A serves on the same host

    # The swap: A sleeps, B wakes and answers, the names callers use move to B; each step timed.
    sleeps.deployment_swap(Deployment.objects.get(pk=a.pk), Deployment.objects.get(pk=b.pk))
    wait_until(lambda: _status(b) == "ready", timeout=30, message="B serving after the swap")
    assert _status(a) == "sleeping" and _engine_asleep(a) and not _engine_asleep(b)
    assert _answer(b) == "Paris."
    assert Route.objects.get(deployment=b).names == [f"chat-{unique}"] and Route.objects.get(deployment=a).names == []
    swap = wait_until(lambda: Deployment.objects.get(pk=b.pk).events.filter(step="swap", data__has_key="seconds").last(),
                      timeout=10, message="the swap's timed step")
    assert swap.data["seconds"] >= SLEEP_S + WAKE_S and f"from a-{unique}" in swap.message
    viewer = Client()
    viewer.force_login(UserFactory(role="viewer"))
    page = viewer.get(f"/deployments/{b.pk}/").content.decode()
    assert 'data-start="wake"' in page and 'data-start="cold"' in page  # its starts: loaded cold, then woken
    assert 'class="badge sleeping">Sleeping' in viewer.get(f"/deployments/{a.pk}/").content.decode()

    # Level 2: the weights are dropped; the wake reads them again (reload_weights) before the KV cache wakes.
    sleeps.deployment_sleep(Deployment.objects.get(pk=b.pk), 2)
    wait_until(lambda: _status(b) == "sleeping", timeout=30, message="B asleep at level 2")
    assert Deployment.objects.get(pk=b.pk).sleep_level == 2
    sleeps.deployment_wake(Deployment.objects.get(pk=b.pk))
    wait_until(lambda: _status(b) == "ready", timeout=30, message="B awake from level 2")
    assert _answer(b) == "Paris."  # uninitialised weights would answer garbage

    # An agent SIGKILLed during a swap: after its restart each row says what its engine is, never both serving.
    sleeps.deployment_swap(Deployment.objects.get(pk=b.pk), Deployment.objects.get(pk=a.pk))
    wait_until(lambda: Deployment.objects.get(pk=b.pk).events.filter(step="sleep", ended__isnull=True).exists()
               or _status(b) != "ready", timeout=30, message="the swap under way")
    time.sleep(random_moment(0.0, SLEEP_S + WAKE_S))
    fault_agent.restart()
    COUNTS["swaps_cut"] += 1
    for d in (a, b):
        wait_until(lambda d=d: _status(d) in Deployment.UP and (_status(d) == "sleeping") == _engine_asleep(d),
                   timeout=30, message=f"{d.name}'s row to say what its engine is")
    assert [_status(a), _status(b)].count("ready") <= 1
    for d, folder in ((a, folders["a"]), (b, folders["b"])):
        assert engines_under(folder) and orphans(folder) == []

    # A swap to a stopped deployment deploys it again; its plan puts the serving one to sleep; the names follow.
    serving, other = (a, b) if _status(a) == "ready" else (b, a)
    if _status(serving) != "ready":  # the kill left both asleep: wake one
        sleeps.deployment_wake(Deployment.objects.get(pk=serving.pk))
        wait_until(lambda: _status(serving) == "ready", timeout=30, message="one of them serving")
    stop_and_check(other, folders["a" if other.pk == a.pk else "b"])
    Route.objects.update_or_create(deployment=serving, defaults={"names": [f"chat-{unique}"]})
    assert sleeps.deployment_swap(Deployment.objects.get(pk=serving.pk), Deployment.objects.get(pk=other.pk)).status == "queued"
    wait_until(lambda: _status(other) == "ready" and _status(serving) == "sleeping", timeout=60,
               message="the stopped one deployed again, the serving one asleep")
    wait_until(lambda: Route.objects.filter(deployment=other, names=[f"chat-{unique}"]).exists(), timeout=10,
               message="the names moved to the one deployed again")
    for d, folder in ((a, folders["a"]), (b, folders["b"])):
        stop_and_check(d, folder)
