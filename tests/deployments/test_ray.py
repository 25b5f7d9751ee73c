"""Ray as the executor: which executors may span nodes, the Ray head's port, the `ray start`
and `vllm serve` command lines of the head and the worker nodes, the plan's order, a Ray head that dies, and
stopping every process a Ray node started.

The real run (two agents, real Ray, the real CPU engine) is tests/e2e/test_ray.py.
"""
import os
import sys
from pathlib import Path
from unittest import mock

import pytest

from deployments.host import osuser, ownership, processes, raynode
from deployments.models import Deployment
from deployments.node import lifecycle, plan, ranks, steps, watch
from deployments.services import deploys, multinode
from plumbing.errors import ServiceError
from tests.deployments.test_deploys import FLAGS, host, model, node  # noqa: F401 - fixtures
from tests.deployments.test_multinode import _node
from tests.conftest import wait_until
from tests.factories import DeploymentFactory, ModelCopyFactory, ModelRepoFactory, UserFactory

pytestmark = pytest.mark.django_db
S = Deployment.Status
RAY = {"tensor-parallel-size": 2, "distributed-executor-backend": "ray"}


FLAGS_MN = sorted({"--tensor-parallel-size", "--port", "--host", "--nnodes", "--node-rank", "--master-addr",
                   "--master-port", "--headless", "--distributed-executor-backend"})


@pytest.fixture
def pair():
    """Two GPU nodes; the worker's engine has no --nnodes (it can join Ray, not vLLM's own multi-node launch)."""
    head, worker = _node("gpu-a", flags=FLAGS_MN), _node("gpu-b", flags=[f for f in FLAGS_MN if f != "--nnodes"])
    model = ModelRepoFactory(files=[{"path": "a", "size": 1}])
    for n in (head, worker):
        ModelCopyFactory(model=model, node=n, path=f"/models/{n.name}")
    return head, worker, model


def _spread(model, head, worker, args):
    return deploys.deployment_create(model=model, node=head, gpu_indices=[0, 1], port=8000, env={}, engine_args=args,
                                     workers=[multinode.Worker(worker, [0, 1])], user=UserFactory(role="admin"))


def test_only_mp_or_ray_may_span_nodes(pair, sent_tasks):
    head, worker, model = pair
    with pytest.raises(ServiceError, match="--distributed-executor-backend uni cannot span nodes") as err:
        _spread(model, head, worker, {"tensor-parallel-size": 4, "distributed-executor-backend": "uni"})
    assert err.value.code == "executor"


def test_ray_over_nodes_needs_no_nnodes_flag_where_mp_does(pair, sent_tasks):
    head, worker, model = pair
    with pytest.raises(ServiceError, match="engine on gpu-b has no --nnodes"):
        _spread(model, head, worker, {"tensor-parallel-size": 4})
    d = _spread(model, head, worker, {**RAY, "tensor-parallel-size": 4})
    assert d.master_port == multinode.MASTER_PORT_FIRST and d.ranks.get().node == worker


def test_a_one_node_ray_deployment_gets_a_ray_head_port_and_loses_it_on_mp(pair, sent_tasks):
    head, _, model = pair
    d = deploys.deployment_create(model=model, node=head, gpu_indices=[0, 1], port=8000, env={}, engine_args=RAY,
                                  user=UserFactory(role="admin"))  # the Ray executor is an admin's choice
    assert d.master_port == multinode.MASTER_PORT_FIRST and not d.ranks.exists()
    assert "Ray head on port 29500" in d.events.get(step="queued").message
    Deployment.objects.filter(pk=d.pk).update(status=S.STOPPED)
    d = deploys.deployment_redeploy(d, engine_args={"tensor-parallel-size": 2})
    assert d.master_port is None


def test_ray_start_argv_of_a_head_and_of_a_worker():
    head = raynode.start_argv("/e/bin/ray", port=29500, node_ip="10.0.0.1", num_gpus=8, temp_dir="/var/p/ray/7")
    assert head[:3] == ["/e/bin/ray", "start", "--block"] and "--head" in head
    for flag, value in (("--port", "29500"), ("--node-ip-address", "10.0.0.1"), ("--num-gpus", "8"),
                        ("--temp-dir", "/var/p/ray/7"), ("--include-dashboard", "false")):
        assert head[head.index(flag) + 1] == value
    worker = raynode.start_argv("/e/bin/ray", port=29500, node_ip="10.0.0.2", num_gpus=None, head_address="10.0.0.1",
                                temp_dir="/var/q/ray/7")
    assert worker[worker.index("--address") + 1] == "10.0.0.1:29500" and "--head" not in worker
    assert "--num-gpus" not in worker  # a CPU node: Ray counts what it finds
    # Two Ray nodes on one host never ask for the same agent port.
    assert head[head.index("--dashboard-agent-listen-port") + 1] != worker[worker.index("--dashboard-agent-listen-port") + 1]


def test_ray_missing_from_the_engine_venv_is_a_clear_error(tmp_path):
    with pytest.raises(raynode.RayError, match=r"Ray is not installed in the engine's environment .*bin/ray is missing"):
        raynode.check_installed(str(tmp_path / "bin" / "ray"))
    assert raynode.ray_bin("/opt/engine/bin/vllm") == "/opt/engine/bin/ray"


def _ray_queued(model, node, **args):
    d = DeploymentFactory(model=model, node=node, port=8000, status=S.QUEUED, master_port=29600,
                          engine_args={**RAY, "served-model-name": "tiny", **args}, env={})
    d.gpus.set(node.gpus.filter(index__in=[0, 1]))
    return d


@pytest.fixture
def ray_host(host):
    host.mocks["serveargv.engine_flags"].return_value = FLAGS | {"--distributed-executor-backend"}
    with mock.patch("deployments.host.raynode.check_installed", autospec=True), \
         mock.patch("deployments.host.raynode.alive_nodes", autospec=True, return_value=1) as alive, \
         mock.patch("deployments.host.ownership.find", autospec=True, return_value=[31337]) as find:
        host.alive_nodes, host.find = alive, find
        yield host


def test_a_ray_deployment_starts_the_ray_head_waits_for_the_cluster_then_vllm_with_the_ray_executor(model, node, ray_host):
    d = _ray_queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.READY, d.status_message
    timeline = [e.step for e in d.events.all()]
    assert timeline.index("ray_head") < timeline.index("ray_cluster") < timeline.index("launch")
    (ray_spec,), (vllm_spec,) = (c.args for c in ray_host.mocks["processes.launch"].call_args_list)
    assert ray_spec.argv[1:4] == ["start", "--block", "--node-ip-address"] and "--head" in ray_spec.argv
    assert ray_spec.argv[ray_spec.argv.index("--port") + 1] == "29600"
    assert ray_spec.argv[ray_spec.argv.index("--num-gpus") + 1] == "2"
    assert ray_spec.env[ownership.MARKER_VAR] == vllm_spec.env[ownership.MARKER_VAR] == d.marker  # one marker
    assert ray_spec.argv[ray_spec.argv.index("--temp-dir") + 1].endswith(f"/ray/{d.pk}")
    argv = " ".join(vllm_spec.argv)
    assert "--distributed-executor-backend ray" in argv and "--nnodes" not in argv and "--master-port" not in argv
    assert vllm_spec.env["RAY_ADDRESS"] == f"{node.address}:29600" and vllm_spec.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    ray_host.alive_nodes.assert_called_with(mock.ANY, f"{node.address}:29600", mock.ANY)


def test_a_ray_head_that_exits_before_the_cluster_is_up_fails_the_plan_before_vllm_starts(model, node, ray_host):
    ray_host.find.return_value = []
    d = _ray_queued(model, node)
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and f"The Ray head on {node} exited" in d.status_message
    assert ray_host.mocks["processes.launch"].call_count == 1  # the Ray head only


def test_a_ready_ray_deployment_whose_ray_head_died_is_failed_by_the_watch(model, node, ray_host):
    d = _ray_queued(model, node)
    Deployment.objects.filter(pk=d.pk).update(status=S.READY, pid=4242, pgid=4242, marker="x")
    ray_host.find.return_value = [4242]  # only the engine's own group carries the marker
    with mock.patch("os.getpgid", return_value=4242):
        watch.deployments_watch(node.pk, {})
    d.refresh_from_db()
    assert d.status == S.FAILED and "its Ray head exited" in d.status_message


def test_a_worker_nodes_rank_is_its_ray_joining_the_head(pair, sent_tasks, tmp_path, settings):
    head, worker, model = pair
    settings.VAR_DIR = tmp_path
    worker.address = "10.0.0.2"
    worker.save()
    d = _spread(model, head, worker, {**RAY, "tensor-parallel-size": 4})
    Deployment.objects.filter(pk=d.pk).update(ray_token="t" * 64)  # made by the head's Ray start
    r = d.ranks.select_related("deployment__node", "node").get()
    with mock.patch("deployments.host.raynode.check_installed", autospec=True), \
         mock.patch("deployments.host.processes.launch", autospec=True,
                    return_value=processes.EngineHandle(pid=5151, pgid=5151)) as launch:
        ranks._launch(r, "/models/gpu-b")
    spec = launch.call_args.args[0]
    assert spec.argv[spec.argv.index("--address") + 1] == f"{head.address}:{d.master_port}"
    assert spec.argv[spec.argv.index("--node-ip-address") + 1] == "10.0.0.2"
    assert spec.argv[spec.argv.index("--num-gpus") + 1] == "2" and "serve" not in spec.argv
    assert spec.env["VLLM_HOST_IP"] == "10.0.0.2" and spec.env[ownership.MARKER_VAR] == d.ranks.get().marker
    # the worker's own, in the engine user's home (or the var dir when engines run as the agent's user)
    user = osuser.current()
    home = Path(user.home) if user.separate else tmp_path
    assert spec.argv[spec.argv.index("--temp-dir") + 1] == str(home / "ray" / str(d.pk))
    assert "Ray node joining" in d.events.get(step="launch@gpu-b").message


def test_stop_marked_ends_every_process_group_carrying_the_marker(tmp_path):
    marker = ownership.new_marker(0)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    groups = [processes.launch(processes.EngineSpec(argv=sleeper, env={ownership.MARKER_VAR: marker},
                                              log_path=tmp_path / f"{i}.log")).pgid for i in range(2)]
    assert len(set(groups)) == 2
    # launch() returns once the child is forked: its marker shows in /proc once it has exec'd
    wait_until(lambda: len(ownership.find(marker)) == 2, timeout=10, message="both marked processes")
    assert lifecycle.stop_marked(marker) == []
    assert ownership.find(marker) == [] and not any(processes.members(g) for g in groups)
    assert os.getpid() not in groups


def test_the_mp_and_uni_executors_need_no_admin_but_ray_or_a_class_path_does():
    from deployments import privileged

    for executor in ("mp", "uni"):
        assert privileged.uses({"distributed-executor-backend": executor}, {}) == {}
    for executor in ("ray", "my.mod.Executor", "external_launcher"):
        assert "--distributed-executor-backend" in privileged.uses({"distributed-executor-backend": executor}, {})
