"""Ray as the executor, end to end: two real node agents on this machine, one of them at
127.0.0.2 (vLLM wants every Ray node at an address of its own; all of 127/8 is this host), a real Ray cluster
the agents start (a head, a worker node joining it) and one real CPU engine, `vllm serve --tensor-parallel-size 2
--distributed-executor-backend ray` on the head, its two workers placed by vLLM over both Ray nodes.

Ready, smoke test answered through the head, authenticated (`ray status`, a Ray driver and the panel's
own status call without the deployment's token are refused; no unauthenticated metrics endpoint); stopped as
one with no Ray or vLLM process left on either "node";
a second deployment on the same agents fails as a whole when the worker node's Ray is killed.
The CPU build declares no Ray device: tests/e2e/vllm_cpu_ray/sitecustomize.py (on the engine's PYTHONPATH)
declares one "GPU" per rank, and RAY_OVERRIDE_RESOURCES gives each Ray node one.
"""
import json
import os
import signal
import shutil
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest
from rest_framework.test import APIClient

from deployments import sealed
from deployments.host import ownership, processenv, processes, raynode
from deployments.models import Deployment, DeploymentRank
from deployments.node import lifecycle, steps
from deployments.services import deploys, multinode
from tests.conftest import VLLM, free_port, wait_until
from tests.e2e.conftest import SMOKE_BOUND_S
from tests.e2e.test_multinode import (agents, firewalled, listening, place_model,  # noqa: F401
                                      stranger)  # a fixture
from tests.factories import UserFactory

# "Nodes" here are this host's addresses: two such clusters at once share its cores, /dev/shm and firewall table
# (a TP-2 engine died at its first request while the other test worker ran another cluster); one at a time.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900), pytest.mark.exclusive("clusters")]
LOAD_TIMEOUT_S = 420
SHIM = Path(__file__).parent / "vllm_cpu_ray"
ENGINE_ARGS = {"tensor-parallel-size": 2, "distributed-executor-backend": "ray", "enforce-eager": True,
               "max-model-len": 512, "max-num-seqs": 8, "served-model-name": "tiny"}
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(SHIM), "RAY_OVERRIDE_RESOURCES": json.dumps({"GPU": 1})}


@pytest.fixture
def short_dir():
    """A var folder with a short path: Ray's Unix sockets live under it (at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="pr", dir="/tmp"))
    path.chmod(0o711)  # mkdtemp makes it 0700: the engine user must enter it to reach the model stores below
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _ours(*markers) -> list[str]:
    """The command lines of processes carrying one of the markers (the panel set them on every Ray node)."""
    return [" ".join(psutil.Process(pid).cmdline())[:120] for m in markers for pid in ownership.find(m)]


@pytest.fixture
def ray_nodes(process_env, spawn, unique, short_dir, tiny_model):
    """(head, worker, model, deployments): two real agents, the tiny model in each one's store; whatever the test
    did, no process carrying a marker of the deployments it appended is left afterwards."""
    (head, head_store), (worker, worker_store) = agents(spawn, process_env, short_dir, (f"ray-a-{unique}", "127.0.0.1"),
                                                        (f"ray-b-{unique}", "127.0.0.2"))
    deployed = []
    try:
        yield head, worker, place_model(tiny_model, head, head_store, worker, worker_store), deployed
    finally:  # never leave a Ray cluster behind, whatever failed
        for d in deployed:
            for m in {Deployment.objects.get(pk=d.pk).marker,
                      *DeploymentRank.objects.filter(deployment=d).values_list("marker", flat=True)} - {""}:
                lifecycle.stop_marked(m)


def _ask(argv, token=None, timeout=90):
    """A Ray command from the engine's environment, as a stranger on the cluster network would run it (no token:
    nothing of the cluster's in its environment, a HOME without ~/.ray/auth_token) or with the token."""
    env = processenv.engine_environ({"HOME": tempfile.mkdtemp(prefix="rayhome"), "RAY_USAGE_STATS_ENABLED": "0",
                                    **(raynode.auth_env(token) if token else {})})
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return result.returncode, result.stdout + result.stderr


def _authenticated(d, rank, stranger):
    """The cluster asks for its token (`ray status`, a Ray driver and the panel's own status call
    without it are refused; with it they answer), the token is sealed at rest, the cluster opens no
    unauthenticated metrics endpoint, and every port it opens beyond loopback refuses a machine that is no
    node (the host firewall); what it listens on (address, port, process, pid) is returned."""
    address, ray = f"127.0.0.1:{d.master_port}", raynode.ray_bin(str(VLLM))
    assert sealed.is_sealed(d.ray_token)  # the row holds ciphertext; the cluster's token is inside
    token = sealed.unseal(d.ray_token)
    assert len(token) == 64 and token not in d.ray_token
    for pid in ownership.find(d.marker) + ownership.find(rank.marker):  # argv is every local user's to read
        assert token not in " ".join(psutil.Process(pid).cmdline())
    code, out = _ask([ray, "status", "--address", address])
    assert code != 0 and "authentication" in out.lower(), out[-2000:]
    code, out = _ask([ray, "status", "--address", address], token=token)
    # Answered ("No cluster status": no autoscaler monitor runs, see raynode.start_argv); the nodes are counted below.
    assert code == 0 and "authentication" not in out.lower(), out[-2000:]
    driver = [str(VLLM.with_name("python")), "-c", f"import ray; ray.init(address='{address}'); print('CONNECTED')"]
    code, out = _ask(driver)
    assert code != 0 and "CONNECTED" not in out and "authentication" in out.lower(), out[-2000:]
    env = processenv.deployment_env({}, [])
    assert raynode.alive_nodes(ray, address, env) == 0  # the panel's own call, without the token: refused
    assert raynode.alive_nodes(ray, address, {**env, **raynode.auth_env(token)}) == 2
    found = listening(d.marker, rank.marker)
    assert any(port == d.master_port for _, port, _, _ in found), found  # the GCS, on the master port
    # No unauthenticated endpoint: neither Ray's metrics export nor the autoscaler's (port 44217) runs.
    assert 44217 not in [port for _, port, _, _ in found], found
    # Where the rest listens is Ray's choice (2.60: the GCS, raylets, object managers and workers on every
    # interface for a node address other than 127.0.0.1, whatever --node-ip-address says): all of it firewalled.
    exposed = firewalled(stranger, d.port, d.marker, rank.marker)
    print("beyond loopback, firewalled:", sorted({(a, p, n) for a, p, n, _ in exposed}))
    return found


def _ray_ready(ray_nodes, name):
    """(deployment, its worker rank): TP 2 with Ray over the two agents, ready and smoke-tested."""
    head, worker, model, deployed = ray_nodes
    d = deploys.deployment_create(model=model, node=head, gpu_indices=[], port=free_port(), engine_args=ENGINE_ARGS,
                                  env=ENGINE_ENV, name=name, master_port=free_port(),
                                  workers=[multinode.Worker(worker, [])], user=UserFactory(role="admin"))  # an admin's choice
    deployed.append(d)
    d = wait_until(lambda: (row := Deployment.objects.get(pk=d.pk)).status in {"ready", "failed"} and row,
                   timeout=LOAD_TIMEOUT_S, interval=0.5, message="the Ray deployment to load")
    assert d.status == "ready", f"{d.status_message}\n{d.log_tail[-3000:]}"
    # As long as the agents' plan asks (SMOKE_BOUND_S): the first answer over Ray on a busy 2-core host took over 120 s.
    d = wait_until(lambda: (row := Deployment.objects.get(pk=d.pk)).smoke and row, timeout=SMOKE_BOUND_S + 30,
                   interval=0.5, message="the smoke test")
    rank = wait_until(lambda: (r := DeploymentRank.objects.get(deployment=d)).state == "running" and r, timeout=30,
                      message="the worker node's Ray running")
    return d, rank


@pytest.mark.slow
def test_a_ray_deployment_over_two_nodes_is_ready_answers_stops_with_nothing_left_and_fails_whole_when_a_nodes_ray_dies(
        ray_nodes, stranger):
    """Two Ray clusters and engine loads over two real agents (~1.5 min each on 2 cores): starting, stopping and
    losing them is what is tested."""
    d, rank = _ray_ready(ray_nodes, "tiny-ray")
    assert d.smoke["completion_tokens"] > 0
    timeline = list(d.events.values_list("step", flat=True))
    worker = rank.node.name
    for step in ("ray_head", f"launch@{worker}", "ray_cluster", "launch", "smoke_test"):
        assert step in timeline
    order = [timeline.index(s) for s in ("ray_head", f"launch@{worker}", "ray_cluster", "launch")]
    assert order == sorted(order)  # the Ray head, the worker node's Ray, all nodes seen, then vLLM
    assert "shows 2 node(s)" in d.events.get(step="ray_cluster").message
    head_cmd = " ".join(psutil.Process(d.pid).cmdline())
    assert "--distributed-executor-backend ray" in head_cmd and "--nnodes" not in head_cmd
    rank_cmd = " ".join(psutil.Process(rank.pid).cmdline())
    assert "ray start" in rank_cmd and f"--address 127.0.0.1:{d.master_port}" in rank_cmd
    # vLLM placed a worker on the worker node: a Ray actor process there carries that node's marker.
    assert any("RayWorkerProc" in " ".join(psutil.Process(p).cmdline()) for p in ownership.find(rank.marker))
    found = _authenticated(d, rank, stranger)
    print("listening:", sorted({(a, p, n) for a, p, n, _ in found}))

    api = APIClient()
    api.force_authenticate(UserFactory(role="operator"))
    assert api.post(f"/api/deployments/{d.pk}/stop/").status_code == 202
    wait_until(lambda: Deployment.objects.get(pk=d.pk).status == "stopped", timeout=120, message="stopped")
    wait_until(lambda: DeploymentRank.objects.get(pk=rank.pk).state == "stopped", timeout=120,
               message="the worker node's Ray stopped")
    assert _ours(d.marker, rank.marker) == [], "a Ray or vLLM process of the stopped deployment is left"
    assert processes.port_free("0.0.0.0", d.port) and processes.port_free("0.0.0.0", d.master_port)

    # A second Ray deployment on the same two agents: the worker node's Ray killed fails it as a whole.
    d, rank = _ray_ready(ray_nodes, "tiny-ray-2")
    markers = (d.marker, rank.marker)
    os.killpg(rank.pgid, signal.SIGKILL)  # the worker node's Ray dies (its whole group, as an OOM kill would)
    d = wait_until(lambda: (row := Deployment.objects.get(pk=d.pk)).status == "failed" and row, timeout=120,
                   interval=0.5, message="the deployment failed")
    assert d.status_message.startswith("Crashed")  # the rank's death or the engine's, whichever was seen first
    assert DeploymentRank.objects.get(pk=rank.pk).state == "failed"
    wait_until(lambda: _ours(*markers) == [], timeout=60,
               message="every Ray and vLLM process of the failed deployment gone")
    assert processes.port_free("0.0.0.0", d.port)
