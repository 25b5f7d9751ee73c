"""Multi-node deployments end to end (issue 17): two real node agents on this machine (their own names,
model stores and queues) run one real CPU-engine deployment with vLLM's own multi-node launch:
`--nnodes 2 --tensor-parallel-size 2` over gloo, the worker `--headless --node-rank 1`.

Ready, smoke test answered on the head, stopped as one with no process left on either "node"; one
rank killed ends the whole deployment failed with the other rank stopped; a worker that cannot
reach the head's port fails the pre-flight naming both nodes. Through panelctl, `--node a --node b`
with the model on neither node: each node downloads its own copy from a Hub-compatible server, one
endpoint answers, and `panelctl stop` ends every rank. A data-parallel layout (DP 2, one replica
per node) runs vLLM's data-parallel launch instead: the worker `--headless --data-parallel-start-rank 1`,
and a request pinned to DP rank 1 is answered by the worker node's replica through the head's endpoint.
"""
import json
import os
import shutil
import signal
import urllib.request

import httpx
import pytest
from rest_framework.test import APIClient

from controlpanel import tokens
from deployments.host import engine, ownership
from deployments.models import Deployment, DeploymentRank, ModelCopy, ModelRepo, Node
from deployments.services import deploys, multinode, ranks, repos
from tests.conftest import VLLM, agent_argv, free_port, in_thread, wait_until
from tests.e2e.test_cli import panelctl
from tests.factories import UserFactory
from tests.hfserver import serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
LOAD_TIMEOUT_S = 420  # two engines start on 2 shared cores
# TP 2 over the two nodes: one rank each. Small and eager, as the CPU engine's preset.
ENGINE_ARGS = {"tensor-parallel-size": 2, "enforce-eager": True, "max-model-len": 512, "max-num-seqs": 8,
               "served-model-name": "tiny"}
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _agent(spawn, process_env, tmp_path, name, address=None):
    """A real node agent with the CPU engine, its own model store and var folder."""
    home = tmp_path / name
    store = home / "store"
    store.mkdir(parents=True)
    env = dict(process_env, VLLM_BIN=str(VLLM), VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), PANEL_VAR_DIR=str(home),
               CPU_HOST_EXCLUSIVE="0")
    argv = agent_argv(name, store, sample_seconds=1, heartbeat_seconds=2)
    if address:
        argv += ["--address", address]
    spawn(argv, env, name=name)
    node = wait_until(lambda: Node.objects.filter(name=name).first(), timeout=60, message=f"agent {name}")
    wait_until(lambda: Node.objects.get(pk=node.pk).engine_version, timeout=180, message=f"the engine on {name}")
    return Node.objects.get(pk=node.pk), store


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
def two_nodes(process_env, spawn, unique, tmp_path, tiny_model, request):
    """(head, worker, model): the tiny model is in each node's own store; the head has it as a local
    model, the worker as a ready copy of it in its store."""
    head_address = getattr(request, "param", None)
    head, head_store = _agent(spawn, process_env, tmp_path, f"mn-a-{unique}", address=head_address)
    worker, worker_store = _agent(spawn, process_env, tmp_path, f"mn-b-{unique}")
    model = place_model(tiny_model, head, head_store, worker, worker_store)
    yield head, worker, model
    for d in Deployment.objects.filter(node=head):  # engines outlive killed agents: never leave one behind
        for pgid in [d.pgid, *d.ranks.values_list("pgid", flat=True)]:
            if pgid:
                engine.stop(pgid, term_timeout_s=5, kill_timeout_s=5)


def _settle(d, states, timeout=LOAD_TIMEOUT_S):
    return wait_until(lambda: (row := Deployment.objects.get(pk=d.pk)).status in states and row, timeout=timeout,
                      interval=0.5, message=f"{d.name} to be {'/'.join(states)}")


def _gone(pgid, marker) -> bool:
    return not engine.members(pgid) and not ownership.find(marker)


def test_two_node_deployment_is_ready_answers_and_stops_as_one(two_nodes):
    head, worker, model = two_nodes
    api = APIClient()
    api.force_authenticate(UserFactory(role="operator"))
    answer = api.post("/api/deployments/", {
        "model": model.pk, "node": head.name, "name": "tiny-2n", "port": free_port(), "master_port": free_port(),
        "preset": "none", "engine_args": ENGINE_ARGS, "env": ENGINE_ENV, "workers": [{"node": worker.name, "gpus": []}],
    }, format="json")
    assert answer.status_code == 202, answer.content
    assert [r["node"] for r in answer.json()["ranks"]] == [worker.name]
    d = _settle(Deployment.objects.get(name="tiny-2n"), {"ready", "failed"})
    assert d.status == "ready", f"{d.status_message}\n{d.log_tail[-3000:]}"
    rank = DeploymentRank.objects.get(deployment=d)
    d = wait_until(lambda: (row := Deployment.objects.get(pk=rank.deployment_id)).smoke and row, timeout=120,
                   message="the smoke test")
    assert d.smoke["completion_tokens"] > 0
    rank = wait_until(lambda: (r := DeploymentRank.objects.get(pk=rank.pk)).state == "running" and r, timeout=30,
                      message="the worker rank running")
    # vLLM's own multi-node launch ran: TP 2 over two nodes, the worker headless with rank 1.
    assert "--headless" in " ".join(_cmdline(rank.pid)) and "--node-rank 1" in " ".join(_cmdline(rank.pid))
    assert "--nnodes 2" in " ".join(_cmdline(d.pid))
    steps = list(d.events.values_list("step", flat=True))
    for step in ("preflight", f"preflight@{worker.name}", "launch_workers", f"launch@{worker.name}", "launch", "smoke_test"):
        assert step in steps
    assert steps.index(f"launch@{worker.name}") < steps.index("launch")  # workers first, then the head
    assert {n["node"] for n in d.load_detail["nodes"]} == {head.name, worker.name}
    shown = api.get(f"/api/deployments/{d.pk}/").json()
    assert shown["ranks"][0]["state"] == "running" and shown["master_port"] == d.master_port

    head_group, head_marker, rank_group, rank_marker = d.pgid, d.marker, rank.pgid, rank.marker
    assert api.post(f"/api/deployments/{d.pk}/stop/").status_code == 202
    d = _settle(d, {"stopped"}, timeout=120)
    wait_until(lambda: DeploymentRank.objects.get(pk=rank.pk).state == "stopped", timeout=120, message="the rank stopped")
    assert _gone(head_group, head_marker) and _gone(rank_group, rank_marker), "an engine process of a stopped rank is left"
    assert engine.port_free("0.0.0.0", d.port)


def test_a_killed_rank_fails_the_whole_deployment_and_stops_the_other(two_nodes):
    head, worker, model = two_nodes
    d = deploys.deployment_create(model=model, node=head, gpu_indices=[], port=free_port(), engine_args=ENGINE_ARGS,
                                  env=ENGINE_ENV, name="tiny-2n-kill", master_port=free_port(),
                                  workers=[multinode.Worker(worker, [])])
    d = _settle(d, {"ready", "failed"})
    assert d.status == "ready", f"{d.status_message}\n{d.log_tail[-3000:]}"
    rank = wait_until(lambda: (r := DeploymentRank.objects.get(deployment=d)).state == "running" and r, timeout=60,
                      message="the worker rank running")
    head_group, head_marker = d.pgid, d.marker
    os.killpg(rank.pgid, signal.SIGKILL)  # the worker node's rank dies (its whole group, as an OOM kill would)

    d = _settle(d, {"failed"}, timeout=120)
    assert f"on node {worker.name} died" in d.status_message
    wait_until(lambda: _gone(head_group, head_marker), timeout=60, message="the head's engine stopped")
    assert DeploymentRank.objects.get(pk=rank.pk).state == "failed"
    assert engine.port_free("0.0.0.0", d.port)


@pytest.mark.parametrize("two_nodes", ["192.0.2.1"], indirect=True)  # TEST-NET-1: routed nowhere
def test_a_worker_that_cannot_reach_the_head_fails_the_preflight_naming_both_nodes(two_nodes):
    head, worker, model = two_nodes
    d = deploys.deployment_create(model=model, node=head, gpu_indices=[], port=free_port(), engine_args=ENGINE_ARGS,
                                  env=ENGINE_ENV, name="tiny-2n-unreachable", master_port=free_port(),
                                  workers=[multinode.Worker(worker, [])])
    d = _settle(d, {"ready", "failed"}, timeout=120)
    assert d.status == "failed"
    assert f"worker node {worker.name} cannot reach head node {head.name} at 192.0.2.1:{d.master_port}" in d.status_message
    assert not d.pid and DeploymentRank.objects.get(deployment=d).pid is None  # nothing was launched
    assert "launch" not in set(d.events.values_list("step", flat=True))


@pytest.fixture
def hub_tiny(tmp_path, tiny_model):
    """A Hugging Face-compatible server holding the tiny model as acme/tiny-2n."""
    shutil.copytree(tiny_model, tmp_path / "hub" / "acme" / "tiny-2n")
    with serve(tmp_path / "hub") as url:
        yield url


def test_panelctl_deploys_over_two_nodes_each_downloading_its_copy_and_stops_every_rank(
        hub_tiny, process_env, spawn, unique, tmp_path, live_server_asgi, operator, settings):
    settings.HF_ENDPOINT = hub_tiny
    env = dict(process_env, HF_ENDPOINT=hub_tiny)
    head, head_store = _agent(spawn, env, tmp_path, f"mn-a-{unique}")
    worker, worker_store = _agent(spawn, env, tmp_path, f"mn-b-{unique}")
    model = ModelRepo.objects.create(repo_id="acme/tiny-2n")
    in_thread(repos.model_inspect, model.pk)
    model.refresh_from_db()
    assert model.files and model.total_size and not ModelCopy.objects.filter(model=model).exists()  # on neither node
    cli = {**os.environ, "PANEL_URL": live_server_asgi, "PANEL_TOKEN": tokens.issue(operator),
           "PANELCTL_CONFIG": str(tmp_path / "none.json")}
    port = free_port()
    try:
        code, out, err = panelctl(cli, "deploy", str(model.pk), "--node", head.name, "--node", worker.name, "--tp", "2",
                                  "--preset", "none", "--name", "cli-2n", "--port", str(port), "--master-port", str(free_port()),
                                  *(f"--flag={k}=" if v is True else f"--flag={k}={v}" for k, v in ENGINE_ARGS.items()
                                    if k != "tensor-parallel-size"),
                                  *(f"--env={k}={v}" for k, v in ENGINE_ENV.items()), "--wait", "--json", "--timeout",
                                  str(LOAD_TIMEOUT_S))
        d = Deployment.objects.get(name="cli-2n")
        assert code == 0, f"{err}\n{d.status_message}\n{d.log_tail[-3000:]}"
        assert json.loads(out)["status"] == "ready" and json.loads(out)["smoke"]["completion_tokens"] > 0
        assert f"Deploying cli-2n (id {d.pk}) on {head.name} + {worker.name}" in err
        # Each node downloaded its own copy into its own store (the worker's in its rank's prepare step).
        for node, store in ((head, head_store), (worker, worker_store)):
            copy = ModelCopy.objects.get(model=model, node=node)
            assert copy.state == "ready" and copy.path.startswith(str(store)) and copy.bytes_done == model.total_size
        assert str(worker_store) in d.events.get(step=f"prepare@{worker.name}").message

        # The one endpoint answers (the head; the worker rank computes half of every layer).
        ask = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content":
               "Name three rivers of Europe and say which one of them is the longest, please."}]}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(ask).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as answer:
            reply = json.load(answer)
        assert reply["usage"]["completion_tokens"] > 0 and reply["choices"][0]["message"]["content"]

        rank = wait_until(lambda: (r := DeploymentRank.objects.get(deployment=d)).state == "running" and r, timeout=30,
                          message="the worker rank running")
        d = Deployment.objects.get(pk=d.pk)
        groups = [(d.pgid, d.marker), (rank.pgid, rank.marker)]
        code, _, err = panelctl(cli, "stop", "cli-2n", "--wait", "--timeout", "120")
        assert code == 0, err
        wait_until(lambda: DeploymentRank.objects.get(pk=rank.pk).state == "stopped", timeout=120, message="the rank stopped")
        assert all(_gone(pgid, marker) for pgid, marker in groups), "an engine process of a stopped rank is left"
        assert engine.port_free("0.0.0.0", port)
    finally:  # engines outlive killed agents: never leave one behind
        for d in Deployment.objects.filter(node=head):
            for pgid in [d.pgid, *d.ranks.values_list("pgid", flat=True)]:
                if pgid:
                    engine.stop(pgid, term_timeout_s=5, kill_timeout_s=5)


def test_a_data_parallel_deployment_over_two_nodes_answers_from_both_replicas_and_stops_as_one(two_nodes):
    head, worker, model = two_nodes
    args = {**ENGINE_ARGS, "tensor-parallel-size": 1, "data-parallel-size": 2}  # one replica on each node
    d = deploys.deployment_create(model=model, node=head, gpu_indices=[], port=free_port(), engine_args=args,
                                  env=ENGINE_ENV, name="tiny-dp2", master_port=free_port(),
                                  workers=[multinode.Worker(worker, [])])
    d = _settle(d, {"ready", "failed"})
    assert d.status == "ready", f"{d.status_message}\n{d.log_tail[-3000:]}"
    d = wait_until(lambda: (row := Deployment.objects.get(pk=d.pk)).smoke and row, timeout=120, message="the smoke test")
    assert d.smoke["completion_tokens"] > 0
    rank = wait_until(lambda: (r := DeploymentRank.objects.get(deployment=d)).state == "running" and r, timeout=60,
                      message="the worker rank running")
    head_argv, rank_argv = " ".join(_cmdline(d.pid)), " ".join(_cmdline(rank.pid))
    address = ranks.head_address(d)
    assert f"--data-parallel-size-local 1 --data-parallel-address {address} --data-parallel-rpc-port {d.master_port}" in head_argv
    assert "--headless" in rank_argv and "--data-parallel-start-rank 1" in rank_argv and "--nnodes" not in rank_argv
    assert "(DP RPC port)" in d.events.get(step="preflight").message
    for dp_rank in (0, 1):  # vLLM routes a request to the DP rank its header names: rank 1 is the worker's replica
        answer = httpx.post(f"http://127.0.0.1:{d.port}/v1/chat/completions", timeout=120,
                            headers={"X-data-parallel-rank": str(dp_rank)},
                            json={"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] > 0, answer.text

    head_group, head_marker, rank_group, rank_marker = d.pgid, d.marker, rank.pgid, rank.marker
    deploys.deployment_stop(d)
    d = _settle(d, {"stopped"}, timeout=120)
    wait_until(lambda: DeploymentRank.objects.get(pk=rank.pk).state == "stopped", timeout=120, message="the rank stopped")
    assert _gone(head_group, head_marker) and _gone(rank_group, rank_marker), "an engine process of a stopped rank is left"
    assert engine.port_free("0.0.0.0", d.port) and engine.port_free("0.0.0.0", d.master_port)


def _cmdline(pid) -> list[str]:
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []
