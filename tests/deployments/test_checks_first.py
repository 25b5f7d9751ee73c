"""Every check that can fail runs before a plan stops anything (deployments/node/precheck.py): a busy port, an
engine that cannot run or refuses a flag, processes the panel did not start on the GPUs. Seen by a user: a
deploy onto a port another program held stopped the serving deployment first, then failed at the launch. The host
is replaced at its boundary as in test_deploys.py (FakeHost); the port holder is a real process, named."""
import subprocess
import sys

import psutil
import pytest

from deployments.host import processes
from deployments.models import Deployment
from deployments.node import plan
from deployments.notify.models import Alert
from tests.deployments.test_deploys import _queued, host, model, node  # noqa: F401 - fixtures
from tests.conftest import wait_until
from tests.factories import DeploymentFactory
from tests.helpers import started

pytestmark = pytest.mark.django_db
S = Deployment.Status


@pytest.fixture
def serving(node):
    """A ready deployment on GPU 0, which the new one (GPUs 0 and 1, port 8000) would replace."""
    d = DeploymentFactory(node=node, status=S.READY, pid=777, pgid=777, port=9000, name="tiny-chat-vm")
    d.gpus.set(node.gpus.filter(index__in=[0]))
    return d


def _untouched(serving, host, d):
    serving.refresh_from_db()
    assert serving.status == S.READY and serving.pid == 777, serving.status_message
    host.mocks["processes.stop"].assert_not_called()
    host.mocks["processes.launch"].assert_not_called()
    assert not d.events.filter(step__in=["sleep_others", "stop_others", "gpu_memory", "launch"]).exists()
    assert not Alert.objects.filter(deployment=serving).exists()


def test_a_port_another_program_holds_fails_the_deploy_and_stops_nothing(model, node, host, serving):
    holder = started(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # port-holder"]))
    try:
        host.mocks["processes.port_free"].return_value = False
        host.mocks["listeners.listening"].return_value = ({holder.pid}, False)
        d = _queued(model, node)
        plan.deployment_run(d.pk)
        d.refresh_from_db()
    finally:
        holder.kill()
        holder.wait()
    assert d.status == S.FAILED
    assert d.status_message.startswith(f"Port 8000 is in use on gpu-01 by PID {holder.pid} (")
    assert "port-holder" in d.status_message and "Nothing was stopped." in d.status_message
    assert [e.step for e in d.events.exclude(step="queued")] == ["model", "checks", "failed"]
    _untouched(serving, host, d)


def test_an_engine_that_cannot_run_fails_the_deploy_naming_the_fix_and_stops_nothing(model, node, host, serving):
    host.mocks["serveargv.engine_flags"].side_effect = processes.EngineError(
        "no engine at vllm: [Errno 2] No such file or directory: 'vllm'", permanent=True)
    d = _queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and "Cannot run the engine: no engine at vllm" in d.status_message
    assert "scripts/install-engine" in d.status_message and "VLLM_BIN" in d.status_message
    _untouched(serving, host, d)


def test_a_flag_the_engine_does_not_take_fails_the_deploy_and_stops_nothing(model, node, host, serving):
    d = _queued(model, node)
    Deployment.objects.filter(pk=d.pk).update(engine_args={"tensor-parallel-size": 2, "max-modle-len": 4096})
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and "unknown engine flag --max-modle-len; did you mean --max-model-len?" in d.status_message
    _untouched(serving, host, d)


def test_a_load_format_whose_package_the_engine_lacks_fails_the_deploy_naming_the_fix_and_stops_nothing(
        model, node, host, serving):
    """The recipe's Blackwell overlay loads with fastsafetensors: without the package vLLM fails at the weights,
    after the predecessor was stopped (36 minutes in, for a large model). The double's engine has none of them."""
    host.mocks["serveargv.engine_flags"].return_value = {*host.mocks["serveargv.engine_flags"].return_value,
                                                         "--load-format"}
    d = _queued(model, node)
    Deployment.objects.filter(pk=d.pk).update(engine_args={"tensor-parallel-size": 2, "load-format": "fastsafetensors"})
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED
    assert ("--load-format fastsafetensors needs the Python package fastsafetensors, which the engine's Python "
            "(/opt/vllm/bin/python) cannot import. To fix it, install it into the engine's environment "
            "(`/opt/vllm/bin/python -m pip install fastsafetensors`)") in d.status_message
    assert [e.step for e in d.events.exclude(step="queued")] == ["model", "checks", "failed"]
    _untouched(serving, host, d)


def test_a_load_format_whose_package_the_engine_has_goes_ahead(model, node, host):
    host.mocks["serveargv.engine_flags"].return_value = {*host.mocks["serveargv.engine_flags"].return_value,
                                                         "--load-format"}
    host.mocks["enginemodules.importable"].return_value = ("/opt/vllm/bin/python", {"fastsafetensors"})
    d = _queued(model, node)
    Deployment.objects.filter(pk=d.pk).update(engine_args={"tensor-parallel-size": 2, "load-format": "fastsafetensors"})
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.READY, d.status_message
    argv = host.spec.argv
    assert argv[argv.index("--load-format") + 1] == "fastsafetensors"


def test_a_foreign_gpu_process_fails_the_deploy_and_stops_nothing(model, node, host, serving, monkeypatch):
    stranger = {"pid": 31337, "user": "bob", "command": "python train.py", "memory": 20 << 30, "display": False}
    monkeypatch.setattr("deployments.node.precheck.foreign_holders", lambda *a, **kw: [stranger])
    d = _queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and "Other processes hold the chosen GPUs: PID 31337 (bob: python train.py, 20480 MiB)" in d.status_message
    _untouched(serving, host, d)


def test_the_port_of_an_engine_the_plan_stops_itself_is_not_in_the_way(model, node, host):
    """The deployment replaced on the same port listens there until the plan stops it: the launch checks again."""
    old = DeploymentFactory(node=node, status=S.READY, pid=777, pgid=777, port=8000, name="old")
    old.gpus.set(node.gpus.filter(index__in=[1]))
    host.mocks["processes.port_free"].side_effect = [False, True]  # before the stop, then at the launch
    d = _queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.READY, d.status_message
    assert d.events.get(step="checks").message.startswith("The engine takes the flags; port 8000 is old's, free once it is stopped")
    assert Deployment.objects.get(pk=old.pk).status == S.STOPPED


def test_a_deployment_stopped_to_make_room_tells_its_subscribers_who_stopped_it_and_why(model, node, host, serving):
    d = _queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.READY, d.status_message
    alert = Alert.objects.get(deployment=serving, kind="displaced")
    assert alert.title == f"tiny-chat-vm was stopped to make room for {d.name}"
    assert alert.body.startswith(f"{d.name} (") and "was deployed on its GPUs: GPUs 0, 1 on gpu-01, port 8000." in alert.body


# --- what the control plane knows before it queues anything: the node's listeners -----------------------------

LISTEN = ("import socket, sys, time\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\n"
          "print(s.getsockname()[1], flush=True)\ntime.sleep(60)\n")


def _listening(env=None) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", LISTEN], stdout=subprocess.PIPE, text=True, env=env)
    return proc, int(proc.stdout.readline())


def test_the_agent_records_who_listens_on_each_port_and_whose_engine_it_is(node, monkeypatch):
    from deployments.host import listeners, ownership
    from deployments.node import guards
    from tests.helpers import marked

    monkeypatch.setattr(listeners, "_READ", (-1e9, {}))  # not another test's read of a moment ago

    engine = DeploymentFactory(node=node, status=S.READY, marker="m-listen-1", port=8000, name="tiny-serving")
    stranger, stranger_port = _listening()
    ours, our_port = _listening({"PATH": "/usr/bin:/bin", ownership.MARKER_VAR: engine.marker})
    try:
        marked(ours.pid, engine.marker)
        described = {}
        found = {p["port"]: p for p in guards.node_listeners_record(node.pk, [], described)}
        again = guards.listeners_of(node.pk, described)  # from what was read: the same answer
    finally:
        for p in (stranger, ours):
            p.kill()
            p.wait()
    assert found[stranger_port]["pid"] == stranger.pid and found[stranger_port]["deployment"] is None
    assert found[stranger_port]["engine"] is False and found[our_port]["engine"] is True
    assert "socket.socket()" in found[stranger_port]["command"]
    assert found[our_port]["pid"] == ours.pid and found[our_port]["deployment"] == engine.pk
    node.refresh_from_db()
    assert {p["port"] for p in node.listeners} >= {stranger_port, our_port}
    assert {p["port"]: p for p in again}[stranger_port] == found[stranger_port]


def test_a_listener_whose_process_is_gone_as_it_is_read_holds_nothing(node, monkeypatch):
    """An engine just stopped: its socket was still listed while its process had already gone, and the port read as
    held by "PID n (?: ?)" until the next reading 5 s later, so a redeploy on it was refused (seen in CI)."""
    import subprocess
    import sys

    from deployments.host import listeners
    from deployments.node import guards

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setattr(listeners, "host_listeners", lambda: {27757: {gone.pid}})
    assert guards.listeners_of(node.pk, {}) == []


def test_a_listener_whose_process_exited_as_it_is_read_holds_nothing(node, monkeypatch):
    """The same with a process that has exited but is not yet reaped (a zombie: an engine's child the moment its stop
    ends it): it exists, yet nothing can be read of it, so the port read as held by "PID n (?: ?)" and a study's next
    redeploy on it was refused (reproduced under load by tests/integration/test_study_verdicts.py)."""
    from deployments.host import listeners
    from deployments.node import guards

    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_until(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE, timeout=10,
                   message="the child to exit, unreaped")
        monkeypatch.setattr(listeners, "host_listeners", lambda: {27758: {zombie.pid}})
        assert guards.listeners_of(node.pk, {}) == []
    finally:
        zombie.wait()


def test_a_listener_that_binds_while_the_host_is_read_is_named_with_its_process(monkeypatch):
    """psutil reads every process's sockets, then the socket tables: an engine that binds between the two reads is
    listed with no PID, so the port read as held by a stranger until the next reading 5 s later and a study's next
    redeploy on it was refused ("Port … is in use"; a study's variant failed in CI). A socket without its PID is
    read again; one still without it (another user's, to an agent that is not root) stays without."""
    from types import SimpleNamespace

    from deployments.host import listeners

    def conn(port, pid):
        return SimpleNamespace(status=psutil.CONN_LISTEN, laddr=SimpleNamespace(port=port), pid=pid)

    reads = iter([[conn(8000, None), conn(9000, None), conn(22, 1)], [conn(8000, 4242), conn(9000, None), conn(22, 1)]])
    monkeypatch.setattr(psutil, "net_connections", lambda kind: next(reads))
    monkeypatch.setattr(listeners, "_READ", (-1e9, {}))
    assert listeners.host_listeners() == {8000: {4242}, 9000: set(), 22: {1}}


def test_a_redeploy_on_its_own_port_is_not_refused_for_a_listener_the_agent_could_not_name(model, node, sent_tasks):
    """The engine being redeployed holds its port, so no stranger can: whatever the agent's last reading could not
    name there (a socket caught as its process ended or began) is that engine's, and the node checks the port again
    after the stop. A study's redeploy was refused for it ("Port … is in use … by PID n (?: ?)")."""
    from deployments.services import deploys
    from plumbing.errors import ServiceError

    serving = DeploymentFactory(model=model, node=node, status=S.READY, port=8000, name="tuned", pid=777,
                                engine_args={"tensor-parallel-size": 2})
    serving.gpus.set(node.gpus.filter(index__in=[0, 1]))
    unnamed = {"port": 8000, "pid": 5619, "user": "?", "command": "?", "deployment": None, "engine": False}
    node.listeners = [unnamed]
    node.save(update_fields=["listeners"])
    assert deploys.deployment_redeploy(serving, engine_args={"tensor-parallel-size": 2, "max-num-seqs": 8}).status == S.QUEUED
    # Another deployment on that port is still refused while the listener is there.
    node.listeners = [{**unnamed, "port": 8100}]
    node.save(update_fields=["listeners"])
    with pytest.raises(ServiceError) as exc:
        deploys.deployment_create(model=model, node=node, gpu_indices=[2, 3], port=8100,
                                  engine_args={"tensor-parallel-size": 2}, env={})
    assert exc.value.code == "port_in_use"


def test_a_deploy_onto_a_port_a_program_listens_on_is_refused_before_anything_is_queued(model, node, sent_tasks):
    from deployments.services import deploys
    from plumbing.errors import ServiceError

    serving = DeploymentFactory(node=node, status=S.READY, port=8000, name="old", pid=777)
    serving.gpus.set(node.gpus.filter(index__in=[0]))
    program = {"port": 18771, "pid": 5150, "user": "alice", "command": "python -m http.server 18771", "deployment": None}
    engine = {"port": 8000, "pid": 777, "user": "vllm-engine", "command": "vllm serve", "deployment": serving.pk,
              "engine": True}
    node.listeners = [program, engine]
    node.save(update_fields=["listeners"])
    args = {"model": model, "node": node, "gpu_indices": [0, 1], "engine_args": {"tensor-parallel-size": 2}, "env": {}}
    with pytest.raises(ServiceError) as exc:
        deploys.deployment_create(port=18771, **args)
    assert (exc.value.code, exc.value.field) == ("port_in_use", "port")
    assert str(exc.value) == ("Port 18771 is in use on gpu-01 by PID 5150 (alice: python -m http.server 18771): "
                              "choose another port, or stop it.")
    assert Deployment.objects.filter(node=node).count() == 1 and sent_tasks.commit().names() == []
    # A long command line keeps its end, where the port is: cut at 60 characters it read "…http.server 1877".
    long = "/tmp/walk45/.venv/bin/python3 -m http.server --directory /srv/some/long/folder/of/files 18771"
    node.listeners = [{**program, "command": long}, engine]
    node.save(update_fields=["listeners"])
    with pytest.raises(ServiceError) as exc:
        deploys.deployment_create(port=18771, **args)
    assert "(alice: /tmp/walk45/.venv/bin/python3 -m http." in str(exc.value)
    assert " … " in str(exc.value) and "long/folder/of/files 18771): choose another port" in str(exc.value)
    # The engine on 8000 is the one this deploy replaces (it holds GPU 0): its port is not in the way. And an engine
    # the panel launched, seen seconds ago, is the rows' to judge: a stopped one's stale record refuses nothing.
    node.listeners = [program, engine, {**engine, "port": 8200, "pid": 778, "deployment": None}]
    node.save(update_fields=["listeners"])
    assert deploys.deployment_create(port=8200, name="after-a-stop", **{**args, "gpu_indices": [2, 3]}).status == S.QUEUED
    assert deploys.deployment_create(port=8000, **args).status == S.QUEUED
    assert deploys.deployment_free_port(node) not in (8000, 18771)


@pytest.mark.parametrize("name, ok", [("tiny chat", False), ('kimi"', False), ("moonshotai/Kimi-K2.5", True),
                                      ("llama3:8b", True), ("", True)])
def test_a_served_name_with_a_space_is_refused_with_what_it_may_hold(name, ok):
    from deployments import flagvalues

    said = flagvalues.problems({"served-model-name": name})
    assert said == [] if ok else said[0].startswith("--served-model-name is the one name callers put in \"model\"")


@pytest.mark.parametrize("flags, said", [
    ({"max-num-seqs": 0}, "--max-num-seqs takes a whole number from 1 up, not '0'"),  # vLLM's ge=1: a failed launch
    ({"max-num-batched-tokens": 0}, "--max-num-batched-tokens takes a whole number from 1 up, not '0'"),
    ({"max-num-queued-reqs": -1}, "--max-num-queued-reqs takes a whole number from 0 up, not '-1'"),
    ({"max-num-seqs": 1, "max-num-queued-reqs": 0}, None),
])
def test_counts_vllm_wants_at_least_one_of_are_refused_at_zero_before_anything_starts(flags, said):
    from deployments import flagvalues

    assert flagvalues.problems(flags) == ([said] if said else [])


def test_json_whose_quotes_the_flags_line_dropped_says_how_to_quote_it_and_quoted_json_meets_the_admin_gate():
    """`--hf-overrides {"trust_remote_code":true}` was refused as "no shell syntax" instead of "admin only"."""
    from deployments import userflags

    with pytest.raises(userflags.ArgsError) as exc:
        userflags.parse_flags('--hf-overrides {"trust_remote_code":true}')
    assert "looks like JSON but is not valid JSON: on the extra-flags line put it in single quotes" in str(exc.value)
    quoted = userflags.parse_flags("""--hf-overrides '{"trust_remote_code":true}'""")
    assert quoted == {"hf-overrides": '{"trust_remote_code":true}'}
    from deployments import flagpolicy

    assert flagpolicy.operator_flag("hf-overrides", quoted["hf-overrides"]) is not None  # an admin's to set


# --- what the control plane knows before it queues anything: the packages the node's engine has ----------------------

@pytest.mark.parametrize("present, error", [
    ([], "--load-format fastsafetensors needs the Python package fastsafetensors, which the engine's Python "
         "(/opt/vllm/bin/python) cannot import. To fix it, install it into the engine's environment "
         "(`/opt/vllm/bin/python -m pip install fastsafetensors`), or deploy without --load-format fastsafetensors"),
    (["fastsafetensors"], None),
])
def test_the_deploy_form_refuses_a_load_format_whose_package_the_node_reported_missing(node, present, error):
    from deployments.forms import DeployForm

    node.engine_flags = [*node.engine_flags, "--load-format"]
    node.engine_modules = {"python": "/opt/vllm/bin/python", "present": present}
    node.save()
    form = DeployForm({"port": 8000, "tp": 1, "pp": 1, "dp": 1, "gpus": ["0"], "gpu_memory_utilization": 0.9,
                       "kv_cache_dtype": "auto", "stall_seconds": 600, "extra_flags": "--load-format fastsafetensors"},
                      node=node)
    form.is_valid()
    assert form.errors.get("extra_flags", [None])[0] == error


def test_the_agent_records_the_optional_packages_its_engines_python_has(node, host):
    from deployments.node import reconcile

    host.mocks["enginemodules.importable"].return_value = ("/opt/vllm/bin/python", {"tensorizer", "bitsandbytes"})
    reconcile.node_engine_report(node.pk)
    node.refresh_from_db()
    assert node.engine_modules == {"python": "/opt/vllm/bin/python", "present": ["bitsandbytes", "tensorizer"]}


def test_on_a_node_without_gpus_the_refusal_and_the_displaced_message_speak_of_the_node(model, sent_tasks):
    # On a CPU node they read "GPUs  are busy: …" (no GPU named) and "deployed on its GPUs … once they are free".
    from deployments.notify import events
    from deployments.services import deploys
    from plumbing.errors import ServiceError
    from tests.factories import NodeFactory

    cpu = NodeFactory(name="cpu-01")
    loading = DeploymentFactory(node=cpu, model=model, status=S.LOADING, name="tiny-chat-vm", port=9000)
    with pytest.raises(ServiceError) as exc:
        deploys.deployment_create(model=model, node=cpu, gpu_indices=[], engine_args={}, env={}, port=8001)
    assert (exc.value.code, str(exc.value)) == ("gpus_busy", "The node is busy: tiny-chat-vm is loading.")
    newer = DeploymentFactory(node=cpu, model=model, status=S.LOADING, name="tc-second", port=18104)
    events._displaced(loading, newer.name)
    alert = Alert.objects.get(deployment=loading, kind="displaced")
    assert "was deployed in its place on cpu-01 (no GPUs: one engine at a time), port 18104." in alert.body
    assert alert.body.endswith("deploy it again from its page once the node is free.") and "GPU" not in alert.body.replace(
        "no GPUs", "")
