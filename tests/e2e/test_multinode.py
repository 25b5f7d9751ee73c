"""Multi-node deployments end to end: real node agents on this machine (their own names, model
stores and queues) run real CPU-engine deployments with vLLM's own multi-node launch:
`--nnodes 2 --tensor-parallel-size 2` over gloo, the worker `--headless --node-rank 1`.

Through panelctl, `--node a --node b` with the model on neither node: each node downloads its own copy from a
Hub-compatible server, the deployment is ready, smoke-tested on the head, its one endpoint answers, and
`panelctl stop` ends every rank with no process left on either "node"; one rank killed ends the whole
deployment failed with the other rank stopped; a worker that cannot reach the head's port fails the pre-flight
naming both nodes. A data-parallel layout (DP 2, one replica per node) runs vLLM's data-parallel launch
instead: the worker `--headless --data-parallel-start-rank 1`, and a request pinned to DP rank 1 is answered by
the worker node's replica (its copy of the model answers differently from the head's) through the head's endpoint.

What is tested is starting and ending engines over several agents, so each test starts its agents once, all at
once, and runs its deployments on them one after the other.
"""
import ipaddress
import json
import os
import re
import shutil
import signal
import struct
import urllib.request
from pathlib import Path

import httpx
import psutil
import pytest
from rest_framework.test import APIClient

from deployments import engineapikey
from deployments.host import firewall, ownership, processes
from deployments.models import Deployment, DeploymentEvent, DeploymentRank, ModelCopy, ModelRepo, Node
from deployments.node import ranks
from deployments.services import deploys, multinode, repos
from plumbing import tokens
from django.conf import settings as django_settings

from tests import netns
from tests.conftest import VLLM, agent_argv, free_port, in_thread, wait_until
from tests.e2e.conftest import SMOKE_BOUND_S
from tests.e2e.test_cli import panelctl
from tests.factories import UserFactory
from tests.hfserver import serve

# "Nodes" here are this host's addresses: two such clusters at once share its cores, /dev/shm and firewall table
# (a TP-2 engine died at its first request while the other test worker ran another cluster); one at a time.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.exclusive("clusters")]
LOAD_TIMEOUT_S = 420  # two engines start on 2 shared cores
# TP 2 over the two nodes: one rank each. Small and eager, as the CPU engine's preset.
ENGINE_ARGS = {"tensor-parallel-size": 2, "enforce-eager": True, "max-model-len": 512, "max-num-seqs": 8,
               "served-model-name": "tiny"}
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
UNREACHABLE = "192.0.2.1"  # TEST-NET-1: routed nowhere


def agents(spawn, process_env, tmp_path, *nodes):
    """Real node agents with the CPU engine, each with its own model store and var folder, for `nodes` given as
    (name, address or None); started together, since each first asks its engine for its flags (~20 s of CPU).
    [(node, store)] once every one has registered and reported its engine."""
    stores = []
    for name, address in nodes:
        store = tmp_path / name / "store"
        store.mkdir(parents=True)
        # One key file for every agent (and this test), as every host of a panel has: a Ray token is sealed with it.
        env = dict(process_env, VLLM_BIN=str(VLLM), VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
                   PANEL_VAR_DIR=str(tmp_path / name), CPU_HOST_EXCLUSIVE="0", PANEL_SMOKE_BOUND_S=str(SMOKE_BOUND_S),
                   HF_TOKEN_KEY_FILE=str(django_settings.HF_TOKEN_KEY_FILE))
        argv = agent_argv(name, store, sample_seconds=1, heartbeat_seconds=2)
        spawn(argv + (["--address", address] if address else []), env, name=name)
        stores.append((name, store))
    return [(wait_until(lambda: Node.objects.filter(name=name).exclude(engine_version="").first(), timeout=240,
                        message=f"agent {name} and its engine's version"), store) for name, store in stores]


def place_model(tiny_model, head, head_store, worker, worker_store):
    """The tiny model in each node's own store: a local model on the head, a ready copy on the worker."""
    for store in (head_store, worker_store):
        shutil.copytree(tiny_model, store / "tiny", dirs_exist_ok=True)
    model = repos.model_add_local(head, str(head_store / "tiny"))
    wait_until(lambda: ModelCopy.objects.filter(model=model, node=head, state="ready").exists(), timeout=60,
               message="the local model on the head")
    # The same files sit in the worker's own store (put there as an operator would: copied by hand).
    ModelCopy.objects.create(model=model, node=worker, state=ModelCopy.State.READY, path=str(worker_store / "tiny"))
    return model


@pytest.fixture
def no_engine_left():
    """Engines run in their own sessions and outlive killed agents: whatever failed, none is left behind."""
    yield
    for d in Deployment.objects.all():
        for pgid in [d.pgid, *d.ranks.values_list("pgid", flat=True)]:
            if pgid:
                processes.stop(pgid, term_timeout_s=5, kill_timeout_s=5)


@pytest.fixture
def stranger():
    """(namespace, its address, this host's address towards it): a machine on the network that is no node."""
    with netns.machines("stranger") as found:
        yield found["stranger"]


def listening(*markers) -> list[tuple[str, int, str, int]]:
    """(address, port, process name, pid) of every TCP socket listening in the deployment's processes (those carrying
    one of the markers) and their descendants (vLLM's titled workers show no marker)."""
    procs = {p.pid: p for m in markers for pid in ownership.find(m) for p in
             [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]}
    found = []
    for proc in procs.values():
        try:
            found += [(c.laddr.ip, c.laddr.port, proc.name(), proc.pid) for c in proc.net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
    return found


def firewalled(stranger, api_port, *markers) -> list[tuple[str, int, str, int]]:
    """Every socket the deployment's processes listen on beyond loopback (Ray's, torch's TCPStore on the
    master port, the DP RPC port, gloo's, ZeroMQ's) is in a group the host firewall guards, and a machine that is
    not a node is refused on each; the engine's API server listens on loopback only, so it is not
    among them. Those sockets are returned."""
    ns, _, host_ip = stranger
    outside = [s for s in listening(*markers) if not ipaddress.ip_address(s[0]).is_loopback]
    assert outside, "nothing listens beyond loopback: nothing was tested"
    api = [s for s in outside if s[1] == api_port]
    assert not api, f"the API server's port is listened on beyond loopback: {api}; all beyond loopback: {outside}"
    assert [s for s in outside if not firewall.covered(s[3])] == [], "sockets outside the firewall's groups"
    for address in {a for a, _, _, _ in outside}:
        ports = sorted({p for a, p, _, _ in outside if a == address})
        target = host_ip if ipaddress.ip_address(address).is_unspecified else address
        answers = netns.connect(ns, target, ports)
        assert answers == {p: "ConnectionRefusedError" for p in ports}, (address, answers)
    return outside


def _why(d, tail: int = 0) -> str:
    """What to read when a deployment failed: its message, then the error lines of each rank's engine log (the
    root cause of an 'EngineCore encountered an issue' is in the log of the rank that broke, not in the tail)."""
    d = Deployment.objects.get(pk=d.pk)
    parts = [d.status_message or ""]
    for name, path in [("head", d.log_path)] + [(f"rank {r.rank}", r.log_path) for r in d.ranks.all()]:
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        errors = [line for line in lines if re.search(r"Error|ERROR|Traceback|Killed|signal|gloo|timed out", line)]
        parts.append(f"--- {name} log {path}: {len(lines)} lines, error lines:\n" + "\n".join(errors[:80]))
        if tail:
            parts.append(f"--- its last {tail} lines:\n" + "\n".join(lines[-tail:]))
    return "\n".join(parts)


def _settle(d, states, timeout=LOAD_TIMEOUT_S):
    return wait_until(lambda: (row := Deployment.objects.get(pk=d.pk)).status in states and row, timeout=timeout,
                      interval=0.5, message=f"{d.name} to be {'/'.join(states)}")


def _smoked(d):
    """Its smoke answer, waited for as long as the agents' plan asks (SMOKE_BOUND_S); a smoke test that failed, or
    none in that time, fails the test with the engines' logs (a hang at the first request shows no error line, so
    the last lines of each log are shown too)."""
    def settled():
        row = Deployment.objects.get(pk=d.pk)
        failed = row.events.filter(step="smoke_test", level=DeploymentEvent.Level.WARNING).exists()
        return (row.smoke or failed or row.status != "ready") and row
    try:
        row = wait_until(settled, timeout=SMOKE_BOUND_S + 30, interval=0.5, message=f"{d.name}'s smoke test")
    except pytest.fail.Exception:
        row = Deployment.objects.get(pk=d.pk)
    if not row.smoke:
        pytest.fail(f"{d.name} gave no smoke answer (status {row.status}): "
                    f"{[e.message for e in row.events.filter(step='smoke_test')]}\n{_why(row, tail=40)}")
    return row


def _rank_running(d):
    return wait_until(lambda: (r := DeploymentRank.objects.get(deployment=d)).state == "running" and r, timeout=60,
                      message="the worker rank running")


def _gone(pgid, marker) -> bool:
    return not processes.members(pgid) and not ownership.find(marker)


@pytest.fixture
def hub_tiny(tmp_path, tiny_model):
    """A Hugging Face-compatible server holding the tiny model as acme/tiny-2n."""
    shutil.copytree(tiny_model, tmp_path / "hub" / "acme" / "tiny-2n")
    with serve(tmp_path / "hub") as url:
        yield url


@pytest.mark.slow
def test_tensor_parallel_over_two_nodes_downloads_answers_stops_and_fails_as_one(
        hub_tiny, process_env, spawn, unique, tmp_path, live_server_asgi, operator, settings, no_engine_left, stranger):
    """Two real TP-2 engine loads over two agents (~1 min each on 2 cores): starting and ending them is what is tested."""
    settings.HF_ENDPOINT = hub_tiny
    env = dict(process_env, HF_ENDPOINT=hub_tiny)
    (head, head_store), (worker, worker_store), (far_head, _) = agents(
        spawn, env, tmp_path, (f"mn-a-{unique}", None), (f"mn-b-{unique}", None), (f"mn-c-{unique}", UNREACHABLE))
    model = ModelRepo.objects.create(repo_id="acme/tiny-2n")
    in_thread(repos.model_inspect, model.pk)
    model.refresh_from_db()
    assert model.files and model.total_size and not ModelCopy.objects.filter(model=model).exists()  # on no node
    cli = {**os.environ, "PANEL_URL": live_server_asgi, "PANEL_TOKEN": tokens.issue(operator),
           "PANELCTL_CONFIG": str(tmp_path / "none.json")}
    port = free_port()
    code, out, err = panelctl(cli, "deploy", str(model.pk), "--node", head.name, "--node", worker.name, "--tp", "2",
                              "--preset", "none", "--name", "cli-2n", "--port", str(port), "--master-port", str(free_port()),
                              *(f"--flag={k}=" if v is True else f"--flag={k}={v}" for k, v in ENGINE_ARGS.items()
                                if k != "tensor-parallel-size"),
                              *(f"--env={k}={v}" for k, v in ENGINE_ENV.items()), "--wait", "--json", "--timeout",
                              str(LOAD_TIMEOUT_S))
    d = Deployment.objects.get(name="cli-2n")
    assert code == 0, f"{err}\n{_why(d)}"
    shown = json.loads(out)
    smoke = d.events.filter(step="smoke_test").last()
    assert shown["status"] == "ready" and shown["smoke"].get("completion_tokens", 0) > 0, smoke and smoke.message
    assert [r["node"] for r in shown["ranks"]] == [worker.name] and shown["master_port"] == d.master_port
    assert f"Deploying cli-2n (id {d.pk}) on {head.name} + {worker.name}" in err
    # Each node downloaded its own copy into its own store (the worker's in its rank's prepare step).
    for node, store in ((head, head_store), (worker, worker_store)):
        copy = ModelCopy.objects.get(model=model, node=node)
        assert copy.state == "ready" and copy.path.startswith(str(store)) and copy.bytes_done == model.total_size
    assert str(worker_store) in d.events.get(step=f"prepare@{worker.name}").message

    # vLLM's own multi-node launch ran: TP 2 over two nodes, the worker headless with rank 1, launched first.
    rank = _rank_running(d)
    assert "--headless" in " ".join(_cmdline(rank.pid)) and "--node-rank 1" in " ".join(_cmdline(rank.pid))
    assert "--nnodes 2" in " ".join(_cmdline(d.pid))
    steps = list(d.events.values_list("step", flat=True))
    for step in ("preflight", f"preflight@{worker.name}", "launch_workers", f"launch@{worker.name}", "launch", "smoke_test"):
        assert step in steps
    assert steps.index(f"launch@{worker.name}") < steps.index("launch")  # workers first, then the head
    assert {n["node"] for n in d.load_detail["nodes"]} == {head.name, worker.name}
    api = APIClient()
    api.force_authenticate(operator)
    assert api.get(f"/api/deployments/{d.pk}/").json()["ranks"][0]["state"] == "running"
    exposed = firewalled(stranger, port, d.marker, rank.marker)
    assert d.master_port in [p for _, p, _, _ in exposed]  # torch's TCPStore: every interface, whatever it is told
    print("beyond loopback, firewalled:", sorted({(a, p, n) for a, p, n, _ in exposed}))

    # The one endpoint answers (the head; the worker rank computes half of every layer).
    ask = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content":
           "Name three rivers of Europe and say which one of them is the longest, please."}]}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(ask).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {engineapikey.of(Deployment.objects.get(pk=d.pk))}"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        reply = json.load(answer)
    assert reply["usage"]["completion_tokens"] > 0 and reply["choices"][0]["message"]["content"]

    groups = [(d.pgid, d.marker), (rank.pgid, rank.marker)]
    code, _, err = panelctl(cli, "stop", "cli-2n", "--wait", "--timeout", "120")
    assert code == 0, err
    wait_until(lambda: DeploymentRank.objects.get(pk=rank.pk).state == "stopped", timeout=120, message="the rank stopped")
    assert all(_gone(pgid, marker) for pgid, marker in groups), "an engine process of a stopped rank is left"
    assert processes.port_free("0.0.0.0", port)

    # Deployed again through the API (both copies are there now): one rank killed fails the whole deployment.
    answer = api.post("/api/deployments/", {
        "model": model.pk, "node": head.name, "name": "tiny-2n-kill", "port": free_port(), "master_port": free_port(),
        "preset": "none", "engine_args": ENGINE_ARGS, "env": ENGINE_ENV, "workers": [{"node": worker.name, "gpus": []}],
    }, format="json")
    assert answer.status_code == 202, answer.content
    assert [r["node"] for r in answer.json()["ranks"]] == [worker.name]
    d = _settle(Deployment.objects.get(name="tiny-2n-kill"), {"ready", "failed"})
    assert d.status == "ready", _why(d)
    d, rank = _smoked(d), _rank_running(d)
    head_group, head_marker = d.pgid, d.marker
    os.killpg(rank.pgid, signal.SIGKILL)  # the worker node's rank dies (its whole group, as an OOM kill would)
    d = _settle(d, {"failed"}, timeout=120)
    assert f"on node {worker.name} died" in d.status_message
    wait_until(lambda: _gone(head_group, head_marker), timeout=60, message="the head's engine stopped")
    assert DeploymentRank.objects.get(pk=rank.pk).state == "failed"
    assert processes.port_free("0.0.0.0", d.port)

    # A head whose agent gives an address that is not its own: the pre-flight fails before anything launches. The
    # head's pre-flight listener binds the cluster address (never every interface), so on one machine the head
    # itself refuses first; on two hosts an address the worker cannot route to fails on the worker's side.
    d = deploys.deployment_create(model=model, node=far_head, gpu_indices=[], port=free_port(), engine_args=ENGINE_ARGS,
                                  env=ENGINE_ENV, name="tiny-2n-unreachable", master_port=free_port(),
                                  workers=[multinode.Worker(worker, [])])
    d = _settle(d, {"ready", "failed"}, timeout=120)
    assert d.status == "failed"
    assert (f"Head node {far_head.name}: cannot listen on port {d.master_port}" in d.status_message
            or f"worker node {worker.name} cannot reach head node {far_head.name} at {UNREACHABLE}:{d.master_port}"
            in d.status_message), d.status_message
    assert not d.pid and DeploymentRank.objects.get(deployment=d).pid is None  # nothing was launched
    assert "launch" not in set(d.events.values_list("step", flat=True))


def negate_final_norm(model_folder):
    """Flip the sign of the model's final norm weights in its safetensors file, in place: every logit changes
    sign, so greedy decoding answers differently, with the same files, sizes and config."""
    path = next(model_folder.glob("*.safetensors"))
    with open(path, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        tensor = json.loads(f.read(size))["model.norm.weight"]
        assert tensor["dtype"] == "BF16", tensor
        start, end = (8 + size + offset for offset in tensor["data_offsets"])
        f.seek(start)
        data = bytearray(f.read(end - start))
        data[1::2] = bytes(b ^ 0x80 for b in data[1::2])  # little-endian bfloat16: the sign is the high byte's top bit
        f.seek(start)
        f.write(data)


def _greedy(d, dp_rank: int) -> str:
    """The tiny model's greedy answer, pinned by vLLM's header to one DP rank (the engine's key: new at every
    launch, so read from the row once it is ready)."""
    answer = httpx.post(f"http://127.0.0.1:{d.port}/v1/chat/completions", timeout=120,
                        headers={"X-data-parallel-rank": str(dp_rank),
                                 "Authorization": f"Bearer {engineapikey.of(Deployment.objects.get(pk=d.pk))}"},
                        json={"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": [
                            {"role": "user", "content": "Which of the rivers of Europe is the longest one, please?"}]})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0, answer.text
    return answer.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_a_data_parallel_deployment_over_two_nodes_answers_from_the_worker_nodes_replica_and_stops_as_one(
        process_env, spawn, unique, tmp_path, tiny_model, no_engine_left, stranger):
    """One real DP-2 engine load over two agents (~1.5 min on 2 cores): starting and stopping it is what is tested."""
    (head, head_store), (worker, worker_store) = agents(spawn, process_env, tmp_path, (f"mn-a-{unique}", None),
                                                        (f"mn-b-{unique}", None))
    model = place_model(tiny_model, head, head_store, worker, worker_store)
    negate_final_norm(worker_store / "tiny")  # the worker's replica, and only it, answers differently
    args = {**ENGINE_ARGS, "tensor-parallel-size": 1, "data-parallel-size": 2}  # one replica on each node
    d = deploys.deployment_create(model=model, node=head, gpu_indices=[], port=free_port(), engine_args=args,
                                  env=ENGINE_ENV, name="tiny-dp2", master_port=free_port(),
                                  workers=[multinode.Worker(worker, [])])
    d = _settle(d, {"ready", "failed"})
    assert d.status == "ready", _why(d)
    d = _smoked(d)
    assert d.smoke["completion_tokens"] > 0
    rank = _rank_running(d)
    # vLLM routes a request to the DP rank its header names. Rank 0 answers the same twice (greedy decoding is
    # repeatable here); rank 1 answers as only the worker's copy can: its replica, on the worker node, served it.
    head_answer = _greedy(d, 0)
    assert _greedy(d, 0) == head_answer
    worker_answer = _greedy(d, 1)
    assert worker_answer != head_answer, f"DP rank 1 answered {worker_answer!r}, as the head's replica does"
    head_argv, rank_argv = " ".join(_cmdline(d.pid)), " ".join(_cmdline(rank.pid))
    address = ranks.head_address(d)
    assert f"--data-parallel-size-local 1 --data-parallel-address {address} --data-parallel-rpc-port {d.master_port}" in head_argv
    assert "--headless" in rank_argv and "--data-parallel-start-rank 1" in rank_argv and "--nnodes" not in rank_argv
    assert str(worker_store / "tiny") in rank_argv
    assert "(DP RPC port)" in d.events.get(step="preflight").message
    exposed = firewalled(stranger, d.port, d.marker, rank.marker)
    print("beyond loopback, firewalled:", sorted({(a, p, n) for a, p, n, _ in exposed}))

    api = APIClient()
    api.force_authenticate(UserFactory(role="operator"))
    head_group, head_marker, rank_group, rank_marker = d.pgid, d.marker, rank.pgid, rank.marker
    assert api.post(f"/api/deployments/{d.pk}/stop/").status_code == 202
    d = _settle(d, {"stopped"}, timeout=120)
    wait_until(lambda: DeploymentRank.objects.get(pk=rank.pk).state == "stopped", timeout=120, message="the rank stopped")
    assert _gone(head_group, head_marker) and _gone(rank_group, rank_marker), "an engine process of a stopped rank is left"
    assert processes.port_free("0.0.0.0", d.port) and processes.port_free("0.0.0.0", d.master_port)


def _cmdline(pid) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []
