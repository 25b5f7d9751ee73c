"""Multi-node placements: what is refused before anything starts, naming the nodes; the ranks
and master port written; the API, the deploy form and the claim across nodes; the pre-flight socket.

The real two-agent, real-engine run is tests/e2e/test_multinode.py.
"""
import socket
from unittest import mock

import pytest
from django.urls import reverse
from django.utils import timezone

from benchmarks import studies
from deployments.forms import DeployForm
from deployments.host import preflight, serveargv
from deployments.models import Deployment, DeploymentRank, Node
from deployments.node import ranks, watch
from deployments.services import deploys, multinode
from panelctl import cli, client
from panelctl.deployments import _placement
from plumbing.errors import ServiceError
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory, StudyFactory

pytestmark = pytest.mark.django_db
FLAGS = sorted({"--tensor-parallel-size", "--pipeline-parallel-size", "--port", "--host", "--nnodes", "--node-rank",
                "--master-addr", "--master-port", "--headless", "--enforce-eager", "--gpu-memory-utilization"})


def _node(name, gpus=2, version="0.32.0", flags=FLAGS):
    node = NodeFactory(name=name, engine_version=version, engine_flags=flags)
    for i in range(gpus):
        GpuFactory(node=node, index=i, memory_total=141 * 10**9)
    return node


@pytest.fixture
def nodes():
    return _node("gpu-a"), _node("gpu-b")


@pytest.fixture
def model(nodes):
    model = ModelRepoFactory(files=[{"path": "a", "size": 1}])
    for node in nodes:
        ModelCopyFactory(model=model, node=node, path=f"/models/{node.name}")
    return model


def _deploy(model, head, worker, tp=4, worker_gpus=(0, 1), **kw):
    return deploys.deployment_create(model=model, node=head, gpu_indices=[0, 1], port=8000,
                                     engine_args={"tensor-parallel-size": tp, **kw.pop("args", {})}, env={},
                                     workers=[multinode.Worker(worker, list(worker_gpus))], **kw)


def test_a_placement_writes_one_rank_per_worker_node_and_a_master_port(model, nodes, sent_tasks):
    head, worker = nodes
    d = _deploy(model, head, worker)
    assert [(r.rank, r.node.name, r.gpu_indices) for r in d.ranks.all()] == [(1, "gpu-b", [0, 1])]
    assert d.master_port == multinode.MASTER_PORT_FIRST
    assert "rank 1 on gpu-b" in d.events.get(step="queued").message
    assert sent_tasks.commit().one("deployments.deployment_run").queue == "node.gpu-a.plans"  # the head's plan coordinates the ranks


def test_nodes_running_different_engine_versions_are_refused_naming_them(model, nodes, sent_tasks):
    head, worker = nodes
    worker.engine_version = "0.31.0"
    worker.save()
    with pytest.raises(ServiceError) as err:
        _deploy(model, head, worker)
    assert "gpu-a runs 0.32.0" in err.value.message and "gpu-b runs 0.31.0" in err.value.message
    assert err.value.code == "engine_versions"


def test_a_layout_that_does_not_split_evenly_over_the_nodes_is_refused(model, nodes, sent_tasks):
    head, worker = nodes
    with pytest.raises(ServiceError, match="TP × PP × DP = 3 cannot be split evenly over 2 nodes"):
        _deploy(model, head, worker, tp=3)
    with pytest.raises(ServiceError, match="runs 2 rank.s. per node; 1 GPU.s. chosen on gpu-b"):
        _deploy(model, head, worker, worker_gpus=[0])


def test_an_offline_worker_node_or_an_engine_without_nnodes_is_refused(model, nodes, sent_tasks):
    head, worker = nodes
    worker.last_heartbeat = None
    worker.save()
    with pytest.raises(ServiceError, match="gpu-b are offline"):
        _deploy(model, head, worker)
    old = _node("gpu-d", flags=[f for f in FLAGS if f != "--nnodes"])
    ModelCopyFactory(model=model, node=old)
    with pytest.raises(ServiceError, match="engine on gpu-d has no --nnodes"):
        _deploy(model, head, old)


def test_a_worker_without_the_model_is_accepted_when_it_can_download_it_there_and_refused_naming_it_otherwise(
        model, nodes, sent_tasks):
    head, _ = nodes
    roomy = _node("gpu-c")
    d = _deploy(model, head, roomy)  # its rank's prepare step downloads the model on gpu-c
    assert d.ranks.get().node == roomy
    Deployment.objects.filter(pk=d.pk).update(status="stopped")
    small = _node("gpu-d")
    small.disk_free = model.total_size // 2
    small.save()
    with pytest.raises(ServiceError, match="Not enough disk space on gpu-d to download") as err:
        _deploy(model, head, small, name="on-small")
    assert err.value.code == "disk_full"
    local = ModelRepoFactory(local_path="/srv/tiny", files=[{"path": "a", "size": 1}])
    ModelCopyFactory(model=local, node=head)
    with pytest.raises(ServiceError, match="not on gpu-c and cannot be downloaded there .a local folder.") as err:
        _deploy(local, head, roomy, name="local")
    assert err.value.code == "not_on_node"


def test_the_flags_the_panel_sets_per_rank_are_refused_from_the_user(model, nodes, sent_tasks):
    head, worker = nodes
    with pytest.raises(ServiceError, match="--node-rank is set by the panel"):
        _deploy(model, head, worker, args={"node-rank": 1})


def test_gpus_a_worker_rank_holds_are_busy_for_a_deploy_on_that_node(model, nodes, sent_tasks):
    head, worker = nodes
    d = _deploy(model, head, worker)
    assert list(deploys.deployment_holders(worker, [1])) == [d]
    assert list(deploys.deployment_holders(worker, [5])) == []
    with pytest.raises(ServiceError, match="busy"):
        deploys.deployment_create(model=model, node=worker, gpu_indices=[0], port=8001,
                                  engine_args={"tensor-parallel-size": 1}, env={})


def test_stop_asks_every_worker_rank_to_stop_on_its_own_node(model, nodes, sent_tasks):
    head, worker = nodes
    d = _deploy(model, head, worker)
    sent_tasks.commit().clear()
    deploys.deployment_stop(d)
    halt = sent_tasks.commit().one("deployments.rank_halt")
    assert (halt.args, halt.queue) == ([d.ranks.get().pk], "node.gpu-b.control")
    assert d.ranks.get().state == DeploymentRank.State.STOPPING


def test_the_head_and_workers_get_vllms_multi_node_flags(model, nodes, sent_tasks):
    head, worker = nodes
    d = _deploy(model, head, worker)
    assert ranks.multinode_args(d, 0, 2) == {"nnodes": 2, "node-rank": 0, "master-addr": head.address,
                                             "master-port": d.master_port}
    assert ranks.multinode_args(d, 1, 2)["headless"] is True


def test_the_api_takes_workers_and_answers_400_for_an_unknown_node(model, nodes, sent_tasks, api):
    head, worker = nodes
    body = {"model": model.pk, "node": head.name, "gpus": [0, 1], "preset": "none",
            "engine_args": {"tensor-parallel-size": 4}, "workers": [{"node": worker.name, "gpus": [0, 1]}]}
    answer = api.post("/api/deployments/", body, format="json")
    assert answer.status_code == 202, answer.content
    assert answer.json()["ranks"][0]["node"] == "gpu-b" and answer.json()["master_port"]
    answer = api.post("/api/deployments/", {**body, "name": "x", "workers": [{"node": "nope"}]}, format="json")
    assert answer.status_code == 400
    assert answer.json()["error"]["fields"]["workers"] == ["0.node: Object with name=nope does not exist."]


def test_the_deploy_form_takes_other_nodes_and_their_gpus(model, nodes):
    head, worker = nodes
    form = DeployForm({"port": 8000, "tp": 4, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
                       "gpus": ["0", "1"], "workers": ["gpu-b"], "worker_gpus": "gpu-b=0,1", "stall_seconds": 600},
                      node=head)
    assert form.is_valid(), form.errors
    assert [(w.node.name, w.gpu_indices) for w in form.cleaned_data["placement"]] == [("gpu-b", [0, 1])]
    form = DeployForm({"port": 8000, "tp": 4, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
                       "workers": ["gpu-b"], "worker_gpus": "gpu-x=0", "stall_seconds": 600}, node=head)
    assert not form.is_valid() and "worker_gpus" in form.errors


def test_a_model_too_big_for_all_nodes_gpus_is_refused():
    head, worker = _node("big-a", gpus=1), _node("big-b", gpus=1)
    model = ModelRepoFactory(files=[{"path": "model.safetensors", "size": 400 * 10**9}], total_size=400 * 10**9,
                             config={"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
                                     "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                                     "vocab_size": 128256, "max_position_embeddings": 8192})
    for node in (head, worker):
        ModelCopyFactory(model=model, node=node)
    with pytest.raises(ServiceError, match="Over big-a, big-b"):
        deploys.deployment_create(model=model, node=head, gpu_indices=[0], port=8000,
                                  engine_args={"tensor-parallel-size": 2}, env={},
                                  workers=[multinode.Worker(worker, [0])])


def test_the_preflight_listener_is_reached_and_a_closed_port_is_not():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with preflight.Listener(port):
        assert preflight.reach("127.0.0.1", port, timeout_s=2) < 2
        with pytest.raises(preflight.PreflightError, match="in use|cannot listen"):
            preflight.Listener(port)
    with pytest.raises(preflight.PreflightError, match=f"cannot connect to 127.0.0.1:{port}"):
        preflight.reach("127.0.0.1", port, timeout_s=2)


def test_a_dead_worker_rank_fails_its_group_from_the_head(model, nodes, sent_tasks):
    head, worker = nodes
    d = _deploy(model, head, worker)
    rank = d.ranks.get()
    DeploymentRank.objects.filter(pk=rank.pk).update(state="running", pid=999999, marker="x")
    sent_tasks.commit().clear()
    ranks.ranks_watch(worker.pk)
    rank.refresh_from_db()
    assert rank.state == "failed" and "engine process exited" in rank.message
    lost = sent_tasks.commit().one("deployments.deployment_rank_lost")
    assert (lost.args, lost.queue) == ([d.pk, rank.pk], "node.gpu-a.control")
    d.status = "ready"
    d.save()
    with mock.patch("deployments.node.lifecycle.halt", autospec=True):
        ranks.deployment_rank_lost(d.pk, rank.pk)
    d.refresh_from_db()
    assert d.status == "failed" and "rank 1 on node gpu-b died" in d.status_message


def test_a_deployment_from_a_single_node_is_not_a_holder_elsewhere(model, nodes):
    head, worker = nodes
    DeploymentFactory(node=head, model=model, status="ready")
    assert list(deploys.deployment_holders(worker, [0])) == []


# --- a redeploy checks the placement again -------------------------------------------------------

def _ready(d):
    Deployment.objects.filter(pk=d.pk).update(status="ready")
    return Deployment.objects.get(pk=d.pk)


def test_a_redeploy_and_a_studys_redeploy_check_the_placement_again_naming_the_node(model, nodes, sent_tasks):
    head, worker = nodes
    d = _ready(_deploy(model, head, worker))
    Node.objects.filter(pk=worker.pk).update(last_heartbeat=None)
    with pytest.raises(ServiceError, match="gpu-b are offline"):
        deploys.deployment_redeploy(d, engine_args={"tensor-parallel-size": 4, "max-num-seqs": 8})
    study = StudyFactory(deployment=d, status="done")
    with pytest.raises(ServiceError, match="gpu-b are offline"):
        studies.study_apply(study, study.variants.get(position=1))
    Node.objects.filter(pk=worker.pk).update(last_heartbeat=timezone.now(), engine_version="0.31.0")
    with pytest.raises(ServiceError, match="gpu-b runs 0.31.0"):
        deploys.deployment_redeploy(d)
    Node.objects.filter(pk=worker.pk).update(engine_version="0.32.0")
    other = DeploymentFactory(node=worker, model=model, status="loading", port=9001, name="other")
    other.gpus.set(worker.gpus.filter(index=1))
    with pytest.raises(ServiceError, match="gpu-b is busy: other is loading"):
        deploys.deployment_redeploy(d)
    assert Deployment.objects.get(pk=d.pk).status == "ready"  # nothing was queued
    Deployment.objects.filter(pk=other.pk).update(status="stopped")
    assert deploys.deployment_redeploy(d).status == "queued"


def test_a_redeploy_takes_new_worker_nodes_from_the_api_and_refuses_what_it_cannot_change(model, nodes, sent_tasks, api):
    head, worker = nodes
    _node("gpu-c")  # no copy there: its rank downloads the model
    d = _ready(_deploy(model, head, worker))
    answer = api.post(f"/api/deployments/{d.pk}/restart/", {"workers": [{"node": "gpu-c", "gpus": [0, 1]}]}, format="json")
    assert answer.status_code == 202, answer.content
    assert [(r["rank"], r["node"], r["gpu_indices"]) for r in answer.json()["ranks"]] == [(1, "gpu-c", [0, 1])]
    assert "on new worker nodes: rank 1 on gpu-c" in d.events.filter(step="queued").last().message
    answer = api.post(f"/api/deployments/{d.pk}/restart/", {"workers": [{"node": "nope"}]}, format="json")
    assert answer.status_code == 400

    d = _ready(d)
    Deployment.objects.filter(pk=d.pk).update(systemd_unit=f"vllm-{d.name}.service")
    with pytest.raises(ServiceError, match="runs as systemd units on its nodes") as err:
        deploys.deployment_redeploy(d, workers=[multinode.Worker(worker, [0, 1])])
    assert err.value.code == "persisted"
    single = _ready(deploys.deployment_create(model=model, node=worker, gpu_indices=[0], port=8001,
                                              engine_args={"tensor-parallel-size": 1}, env={}))
    with pytest.raises(ServiceError, match="deploy a new one to change that"):
        deploys.deployment_redeploy(single, workers=[multinode.Worker(head, [0])])


def test_the_edit_page_shows_the_placement_and_a_redeploy_from_it_moves_a_rank(model, nodes, sent_tasks, operator_client):
    head, worker = nodes
    _node("gpu-c")
    d = _ready(_deploy(model, head, worker))
    assert "gpu-b=0,1" in operator_client.get(f"/deployments/{d.pk}/edit/").content.decode()
    form = {"port": 8000, "tp": 4, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
            "gpus": ["0", "1"], "workers": ["gpu-c"], "worker_gpus": "gpu-c=0,1", "stall_seconds": 600}
    answer = operator_client.post(f"/deployments/{d.pk}/edit/", form)
    assert answer.status_code == 302, answer.content.decode()[-2000:]
    assert [(r.node.name, r.gpu_indices) for r in d.ranks.all()] == [("gpu-c", [0, 1])]


# --- if any rank dies: failed, or restarted as a whole -------------------------------------------

def _three_nodes(model, nodes, **kw):
    head, worker = nodes
    third = _node("gpu-c")
    d = deploys.deployment_create(model=model, node=head, gpu_indices=[0, 1], port=8000, env={},
                                  engine_args={"tensor-parallel-size": 6}, workers=[multinode.Worker(worker, [0, 1]),
                                                                                   multinode.Worker(third, [0, 1])], **kw)
    return _ready(d), third


def test_auto_restart_after_a_rank_dies_runs_every_rank_again(model, nodes, sent_tasks):
    d, third = _three_nodes(model, nodes, auto_restart=True)
    dead, other = d.ranks.order_by("rank")
    DeploymentRank.objects.filter(pk__in=[dead.pk, other.pk]).update(state="running")
    DeploymentRank.objects.filter(pk=dead.pk).update(state="failed", message="its engine process exited")
    sent_tasks.commit().clear()
    ranks.deployment_rank_lost(d.pk, dead.pk)
    d.refresh_from_db()
    assert d.status == "queued" and d.restarts == 1 and "rank 1 on node gpu-b died" in d.events.get(step="failed").message
    plan, halt = sent_tasks.commit().one("deployments.deployment_run"), sent_tasks.one("deployments.rank_halt")
    assert plan.queue == "node.gpu-a.plans" and plan.options["countdown"] == 10
    assert (halt.args, halt.queue) == ([other.pk], "node.gpu-c.control")  # the live rank stopped first
    assert DeploymentRank.objects.get(pk=other.pk).state == "stopping"
    watch.deployment_crashed(d, "the engine process exited")  # the head's watch saw its engine die too: one restart
    d.refresh_from_db()
    assert d.status == "queued" and d.restarts == 1

    # The restarted plan (on the head) sends every rank its part again, the dead one included.
    ranks.ranks_send(d)
    assert sorted((s.args[0], s.queue) for s in sent_tasks.commit().of("deployments.rank_run")) == [
        (dead.pk, "node.gpu-b.plans"), (other.pk, "node.gpu-c.plans")]
    ranks.rank_halt(other.pk)  # the crash's stop, arriving late on a busy node, leaves the new run alone
    assert set(d.ranks.values_list("state", flat=True)) == {"pending"}


def test_auto_restart_is_not_tried_when_a_worker_nodes_gpus_were_taken_meanwhile(model, nodes, sent_tasks):
    d, third = _three_nodes(model, nodes, auto_restart=True)
    dead = d.ranks.get(rank=1)
    DeploymentRank.objects.filter(deployment=d).update(state="running")
    DeploymentRank.objects.filter(pk=dead.pk).update(state="failed")
    taker = DeploymentFactory(node=third, model=model, status="ready", port=9002, name="taker")
    taker.gpus.set(third.gpus.filter(index=0))
    ranks.deployment_rank_lost(d.pk, dead.pk)
    d.refresh_from_db()
    assert d.status == "failed" and d.restarts == 0
    assert "Not restarted: taker uses its GPUs on gpu-c now." in d.events.get(step="auto_restart").message


def test_panelctl_takes_each_node_once_the_first_as_head_each_with_its_own_gpus():
    assert _placement(["gpu-a", "gpu-b:2,3"]) == {"gpu-a": None, "gpu-b": [2, 3]}
    with pytest.raises(client.CliError, match="--node gpu-a is given twice"):
        _placement(["gpu-a", "gpu-a:1"])
    with pytest.raises(client.CliError, match="GPU indices are numbers separated by commas"):
        _placement(["gpu-a", "gpu-b:x"])


# --- data-parallel layouts (DP > 1): vLLM's data-parallel launch, whole replicas per node ------------

DP_FLAGS = sorted({*FLAGS, "--data-parallel-size", "--data-parallel-size-local", "--data-parallel-start-rank",
                   "--data-parallel-address", "--data-parallel-rpc-port"})


@pytest.fixture
def dp_nodes(model):
    """Two GPU nodes (2 and 4 GPUs) whose engine offers the data-parallel flags, with the model on both."""
    head, worker = _node("dp-a", gpus=2, flags=DP_FLAGS), _node("dp-b", gpus=4, flags=DP_FLAGS)
    for node in (head, worker):
        ModelCopyFactory(model=model, node=node, path=f"/models/{node.name}")
    return head, worker


def _dp(model, head, worker, dp, worker_gpus, tp=1, head_gpus=(0, 1), args=None, **kw):
    return deploys.deployment_create(model=model, node=head, gpu_indices=list(head_gpus), port=8000,
                                     engine_args={"tensor-parallel-size": tp, "data-parallel-size": dp, **(args or {})},
                                     env={}, workers=[multinode.Worker(worker, list(worker_gpus))], **kw)


def test_a_data_parallel_layout_launches_vllms_dp_form_with_each_nodes_replicas_and_start_rank(model, dp_nodes, sent_tasks):
    head, worker = dp_nodes
    d = _dp(model, head, worker, dp=6, worker_gpus=[0, 1, 2, 3])  # 2 replicas on the head, 4 on the worker
    assert ranks.multinode_args(d, 0, 2) == {"data-parallel-size-local": 2, "data-parallel-address": head.address,
                                             "data-parallel-rpc-port": d.master_port}
    assert ranks.multinode_args(d, 1, 2) == {"data-parallel-size-local": 4, "data-parallel-address": head.address,
                                             "data-parallel-rpc-port": d.master_port, "headless": True,
                                             "data-parallel-start-rank": 2}
    argv = " ".join(serveargv.build_argv("vllm", "/m", d.port, "0.0.0.0", {**d.engine_args, **ranks.multinode_args(d, 1, 2)}))
    assert "--data-parallel-size 6 --data-parallel-size-local 4" in argv and "--nnodes" not in argv
    assert f"DP RPC port {d.master_port}" in d.events.get(step="queued").message
    d.ranks.update(state="stopped")
    Deployment.objects.filter(pk=d.pk).update(status="stopped")
    d2 = _dp(model, head, worker, dp=2, tp=2, worker_gpus=[2, 3], name="tp2")  # TP 2 per replica: one on each node
    assert [a["data-parallel-size-local"] for a in (ranks.multinode_args(d2, 0, 2), ranks.multinode_args(d2, 1, 2))] == [1, 1]
    assert ranks.multinode_args(d2, 1, 2)["data-parallel-start-rank"] == 1


def test_a_data_parallel_split_that_does_not_add_up_is_refused_naming_the_nodes(model, dp_nodes, sent_tasks):
    head, worker = dp_nodes
    with pytest.raises(ServiceError, match="the 1 GPU.s. chosen on dp-b are not whole replicas"):
        _dp(model, head, worker, dp=2, tp=2, worker_gpus=[0])
    with pytest.raises(ServiceError, match=r"DP = 5 replicas of TP × PP = 1, but the GPUs chosen hold 4 \(dp-a: 2, dp-b: 2\)"):
        _dp(model, head, worker, dp=5, worker_gpus=[0, 1])
    with pytest.raises(ServiceError, match="no GPU chosen on dp-b"):
        _dp(model, head, worker, dp=2, worker_gpus=[])
    cpu_a, cpu_b = _node("cpu-a", gpus=0, flags=DP_FLAGS), _node("cpu-b", gpus=0, flags=DP_FLAGS)
    for node in (cpu_a, cpu_b):
        ModelCopyFactory(model=model, node=node)
    with pytest.raises(ServiceError, match="DP = 3 replicas cannot be split evenly over the 2 CPU nodes cpu-a, cpu-b"):
        _dp(model, cpu_a, cpu_b, dp=3, worker_gpus=[], head_gpus=[])
    d = _dp(model, cpu_a, cpu_b, dp=2, worker_gpus=[], head_gpus=[])  # one replica (one process) per CPU node
    assert ranks.multinode_args(d, 1, 2)["data-parallel-size-local"] == 1


def test_an_engine_without_the_data_parallel_flags_or_a_user_set_rpc_port_is_refused(model, dp_nodes, sent_tasks):
    head, worker = dp_nodes
    old = _node("dp-old", gpus=2)  # --nnodes, but none of the data-parallel launch's flags
    ModelCopyFactory(model=model, node=old)
    with pytest.raises(ServiceError, match="engine on dp-old has no --data-parallel-size"):
        _dp(model, head, old, dp=4, worker_gpus=[0, 1])
    with pytest.raises(ServiceError, match="--data-parallel-rpc-port is set by the panel"):
        _dp(model, head, worker, dp=4, worker_gpus=[0, 1], args={"data-parallel-rpc-port": 1234})


def test_the_preflight_of_a_data_parallel_layout_tests_the_dp_rpc_port(model, dp_nodes, sent_tasks):
    head, worker = dp_nodes
    d = _dp(model, head, worker, dp=4, worker_gpus=[0, 1])
    port = ranks.multinode_args(d, 1, 2)["data-parallel-rpc-port"]
    with socket.socket() as probe:  # a free port for the test: the deployment's own may be taken on this host
        probe.bind(("127.0.0.1", 0))
        d.master_port = port = probe.getsockname()[1]
    reached = []

    def worker_reports(d, states, timeout_s, what):  # what the worker node's rank_run does, in this thread
        if DeploymentRank.State.REACHED in states:
            reached.append(preflight.reach(head.address, port, timeout_s=2))

    with mock.patch.object(ranks, "ranks_wait", side_effect=worker_reports):
        message = ranks.head_preflight(d)
    assert reached and f"reached head node dp-a at {head.address}:{port} (DP RPC port)" in message


def test_the_api_and_the_deploy_form_take_a_data_parallel_layout(model, dp_nodes, sent_tasks, api):
    head, worker = dp_nodes
    body = {"model": model.pk, "node": head.name, "gpus": [0, 1], "preset": "none",
            "engine_args": {"tensor-parallel-size": 1, "data-parallel-size": 4}, "workers": [{"node": worker.name, "gpus": [0, 1]}]}
    answer = api.post("/api/deployments/", {**body, "engine_args": {"data-parallel-size": 3}}, format="json")
    assert answer.status_code == 400 and "DP = 3 replicas" in answer.json()["error"]["message"]
    answer = api.post("/api/deployments/", body, format="json")
    assert answer.status_code == 202, answer.content
    assert answer.json()["engine_args"]["data-parallel-size"] == 4 and answer.json()["ranks"][0]["gpu_indices"] == [0, 1]
    form = DeployForm({"port": 8001, "tp": 1, "pp": 1, "dp": 4, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
                       "gpus": ["0", "1"], "workers": ["dp-b"], "worker_gpus": "dp-b=2,3", "stall_seconds": 600}, node=head)
    assert form.is_valid(), form.errors
    assert form.cleaned_data["engine_args"]["data-parallel-size"] == 4
    assert [(w.node.name, w.gpu_indices) for w in form.cleaned_data["placement"]] == [("dp-b", [2, 3])]


# --- telemetry across nodes ----------------------------------------------------------------------

def _sample(gpus, ram_total=64 * 2**30, ram_available=48 * 2**30):
    return {"t": 1.0, "gpus": [{"index": i, "memory_used": used, "memory_total": 141 * 10**9, "util_gpu": 0,
                                "temperature_c": 30, "power_w": 100} for i, used in gpus.items()],
            "disk": {"free": 1, "total": 2}, "host": {"ram_total": ram_total, "ram_available": ram_available, "load1": 0.0}}


def test_the_deployment_page_shows_every_nodes_gpu_memory_and_the_worker_page_its_rank(model, nodes, sent_tasks, operator_client):
    from deployments import history

    head, worker = nodes
    d = _deploy(model, head, worker)
    history.push(head.pk, _sample({0: 3 * 2**30, 1: 5 * 2**30}))
    history.push(worker.pk, _sample({0: 7 * 2**30, 1: 9 * 2**30}))
    page = operator_client.get(reverse("deployment-detail", args=[d.pk])).content.decode()
    table = page[page.index('id="node-gpus"'):page.index("</table>", page.index('id="node-gpus"'))]
    for node, gpu, used in ((head, 0, "3.0 GiB"), (head, 1, "5.0 GiB"), (worker, 0, "7.0 GiB"), (worker, 1, "9.0 GiB")):
        row = table[table.index(f'data-node="{node.pk}" data-gpu="{gpu}"'):]
        assert used in row[:row.index("</tr>")] and reverse("node-detail", args=[node.pk]) in row[:row.index("</tr>")]
    assert f"nodes: [{head.pk},{worker.pk}]" in page  # the page follows both nodes' live feeds

    page = operator_client.get(reverse("node-detail", args=[worker.pk])).content.decode()
    ranks_table = page[page.index('id="ranks"'):]
    assert reverse("deployment-detail", args=[d.pk]) in ranks_table and reverse("node-detail", args=[head.pk]) in ranks_table
    assert "Nothing deployed here" not in page
    head_page = operator_client.get(reverse("node-detail", args=[head.pk])).content.decode()
    assert 'id="ranks"' not in head_page  # the head's own deployment is listed as served there, not as a rank


def test_a_cpu_node_of_a_deployment_shows_its_ram_and_a_ranks_processes_are_labelled_with_its_deployment(model, sent_tasks, operator_client):
    from deployments import history
    from deployments.services import nodes as node_services

    head, worker = _node("cpu-h", gpus=0), _node("cpu-w", gpus=0)
    for node in (head, worker):
        ModelCopyFactory(model=model, node=node)
    d = deploys.deployment_create(model=model, node=head, gpu_indices=[], port=8000, engine_args={"tensor-parallel-size": 2},
                                  env={}, workers=[multinode.Worker(worker, [])])
    history.push(worker.pk, _sample({}, ram_total=32 * 2**30, ram_available=20 * 2**30))
    page = operator_client.get(reverse("deployment-detail", args=[d.pk])).content.decode()
    row = page[page.index(f'data-node="{worker.pk}" data-ram="1"'):]
    assert "RAM 12.0 GiB / 32.0 GiB" in row[:row.index("</tr>")]
    DeploymentRank.objects.filter(deployment=d).update(pid=4242, pgid=4240, state="running")
    owners = node_services.node_engines(worker.pk)
    assert owners[4240] == owners[4242] == {"id": d.pk, "name": f"{d.name} (rank 1)"}


def test_panelctl_deploy_takes_a_data_parallel_layout_over_nodes(model, dp_nodes, sent_tasks, api):
    from tests.deployments.test_first_hour import ApiPanel

    head, worker = dp_nodes
    args = cli.parser().parse_args(["deploy", str(model.pk), "--node", head.name, "--node", worker.name, "--tp", "1",
                                    "--dp", "4", "--preset", "none", "--name", "dp4"])
    assert args.fn(ApiPanel(api), args) == 0
    d = Deployment.objects.get(name="dp4")
    assert d.engine_args["data-parallel-size"] == 4 and d.gpu_indices == [0, 1]
    assert [(r.node.name, r.gpu_indices) for r in d.ranks.all()] == [("dp-b", [0, 1])]
    assert ranks.multinode_args(d, 1, 2)["data-parallel-start-rank"] == 2


def test_a_redeploy_whose_data_parallel_split_no_longer_adds_up_is_refused(model, dp_nodes, sent_tasks):
    head, worker = dp_nodes
    d = _dp(model, head, worker, dp=4, worker_gpus=[0, 1])
    Deployment.objects.filter(pk=d.pk).update(status="failed")
    with pytest.raises(ServiceError, match=r"DP = 6 replicas .* hold 4 \(dp-a: 2, dp-b: 2\)"):
        deploys.deployment_redeploy(d, engine_args={**d.engine_args, "data-parallel-size": 6})
    assert deploys.deployment_redeploy(d, engine_args={**d.engine_args}).status == "queued"
