"""Multi-node deployments on their nodes: persisted as one systemd unit per node (workers first),
stopped, adopted and deleted through those units; a worker rank downloading the model in its prepare step.

systemd, the engine and the GPUs are replaced at their boundary (test_deploys.FakeHost; systemctl and
install mocked, as for a one-node persist); each worker rank's task runs in a thread of its own, as its
node's agent would run it; downloads come from the Hub-compatible test server. The real two-agent,
real-engine run is tests/e2e/test_multinode.py.
"""
import shutil
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
from django.db import connection

from deployments.host import ownership, systemd
from deployments.models import Deployment, DeploymentRank, ModelCopy, ModelRepo
from deployments.node import persist, ranks, watch
from deployments.services import deploys, multinode, repos
from plumbing.errors import ServiceError
from tests.conftest import free_port
from tests.deployments.test_deploys import FakeHost, _clock
from tests.deployments.test_multinode import _node
from tests.factories import ModelCopyFactory, ModelRepoFactory
from tests.hfserver import serve
from tests.taskqueue import Sent

S = Deployment.Status


def _placed(model, head, worker, **kw):
    """A deployment over head (GPUs 0, 1) and worker (rank 1, GPUs 0, 1), as the control plane writes it."""
    return deploys.deployment_create(model=model, node=head, gpu_indices=[0, 1], port=8000, env={},
                                     engine_args={"tensor-parallel-size": 4}, workers=[multinode.Worker(worker, [0, 1])],
                                     **kw)


def _closing(fn, *args):
    """A task on another node's agent: its own database connection, closed at the end."""
    try:
        fn(*args)
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_persisting_a_multi_node_deployment_runs_every_rank_under_a_unit_on_its_own_node_workers_first(
        tmp_path, settings, sent_tasks):
    settings.VAR_DIR = tmp_path
    head, worker = _node("gpu-a"), _node("gpu-b")
    model = ModelRepoFactory(files=[{"path": "a", "size": 1}])
    for node in (head, worker):
        ModelCopyFactory(model=model, node=node, path=str(tmp_path / node.name))
    d = _placed(model, head, worker, name="kimi", master_port=free_port())
    Deployment.objects.filter(pk=d.pk).update(status=S.READY, pid=4242, pgid=4242, marker="head-marker")
    DeploymentRank.objects.filter(deployment=d).update(state="running", pid=4343, pgid=4343, marker="rank-marker")
    with pytest.raises(ServiceError, match="gpu-a, gpu-b cannot keep engines across reboots"):
        deploys.deployment_persist(d)
    head.systemd = worker.systemd = True
    head.save()
    worker.save()
    deploys.deployment_persist(d)
    sent = sent_tasks.of("deployments.deployment_persist")[-1]
    assert (sent.args, sent.queue) == ([d.pk], "node.gpu-a.plans")  # the head's node runs it

    threads = []

    def enqueue(name, args, queue, **kw):  # a worker node's agent takes its task from its own queue
        assert (name, queue) == ("deployments.rank_run", worker.queue)
        threads.append(threading.Thread(target=_closing, args=(ranks.rank_run, *args)))
        threads[-1].start()

    pids = {"vllm-kimi.rank1.service": 6666, "vllm-kimi.service": 5555}
    with _clock(time.monotonic), FakeHost(tmp_path) as host, \
            mock.patch("deployments.node.ranks.enqueue", side_effect=enqueue), \
            mock.patch("deployments.host.systemd.systemctl", autospec=True) as systemctl, \
            mock.patch("deployments.host.systemd.install", autospec=True,
                       side_effect=lambda name, text, **kw: pids[name]) as install, \
            mock.patch("os.getpgid", side_effect=lambda pid: pid):
        persist.deployment_persist_here(d.pk)
        for thread in threads:
            thread.join(60)
        d.refresh_from_db()
        rank = d.ranks.get()
        assert d.status == S.READY, d.status_message
        assert (d.systemd_unit, d.pid, rank.state, rank.pid) == ("vllm-kimi.service", 5555, "running", 6666)
        # Each node installed its own rank's unit, the worker's before the head's (vLLM's launch order).
        assert [c.args[0] for c in install.call_args_list] == ["vllm-kimi.rank1.service", "vllm-kimi.service"]
        rank_text, head_text = (c.args[1] for c in install.call_args_list)
        assert '"--headless"' in rank_text and '"--node-rank" "1"' in rank_text and f"{ownership.MARKER_VAR}=" in rank_text
        assert '"--nnodes" "2"' in head_text and '"--headless"' not in head_text
        assert {c.args[0] for c in host.mocks["processes.stop"].call_args_list} == {4242, 4343}  # the engines they replace
        steps = list(d.events.values_list("step", flat=True))
        assert steps.index("launch@gpu-b") < steps.index("launch") and "persist" in steps

        # An agent restarting on the worker node adopts the rank its unit runs.
        assert ranks.ranks_reconcile(worker)["adopted"] == [str(rank)]

        # Stop: every node disables its own unit (so nothing comes back at the next boot).
        deploys.deployment_stop(d)
        halt = sent_tasks.of("deployments.rank_halt")[-1]
        assert (halt.args, halt.queue) == ([rank.pk], "node.gpu-b.control")
        watch.deployment_halt(d.pk)
        ranks.rank_halt(rank.pk)
        assert mock.call("disable", "--now", "vllm-kimi.service") in systemctl.call_args_list
        assert mock.call("disable", "--now", "vllm-kimi.rank1.service") in systemctl.call_args_list
        assert Deployment.objects.get(pk=d.pk).status == S.STOPPED and DeploymentRank.objects.get(pk=rank.pk).state == "stopped"

        # Delete: the worker node removes its rank's unit, then the head its own, then the row goes.
        assert deploys.deployment_delete(d) is False
        assert sent_tasks[-1] == Sent("deployments.rank_forget", [rank.pk], {"queue": "node.gpu-b.control"})
        ranks.rank_forget(rank.pk)
        assert sent_tasks[-1] == Sent("deployments.deployment_forget", [d.pk], {"queue": "node.gpu-a.control"})
        watch.deployment_forget(d.pk)
    assert systemctl.call_args_list[-4:] == [mock.call("disable", "--now", "vllm-kimi.rank1.service"), mock.call("daemon-reload"),
                                             mock.call("disable", "--now", "vllm-kimi.service"), mock.call("daemon-reload")]
    assert not Deployment.objects.filter(pk=d.pk).exists()


def test_a_unit_never_installed_on_a_node_has_nothing_to_disable():
    """A rank moved under systemd has no unit yet when its old engine stops; any other systemctl error stands."""
    missing = systemd.SystemdError("systemctl disable --now x failed: Unit file x.service does not exist.")
    with mock.patch("deployments.host.systemd.systemctl", autospec=True, side_effect=missing):
        systemd.disable("vllm-x.service")
    with mock.patch("deployments.host.systemd.systemctl", autospec=True, side_effect=systemd.SystemdError("Access denied")):
        with pytest.raises(systemd.SystemdError, match="Access denied"):
            systemd.disable("vllm-x.service")


@pytest.mark.django_db
def test_a_worker_rank_downloads_the_model_on_its_own_node_in_its_prepare_step(tmp_path, tiny_model_files, settings, sent_tasks):
    shutil.copytree(tiny_model_files, tmp_path / "hub" / "acme" / "tiny")
    head, worker = _node("gpu-a"), _node("gpu-b")
    worker.model_store = str(tmp_path / "store-b")
    worker.save()
    with serve(tmp_path / "hub") as url:
        settings.HF_ENDPOINT = url
        model = ModelRepo.objects.create(repo_id="acme/tiny")
        repos.model_inspect(model.pk)
        model.refresh_from_db()
        ModelCopyFactory(model=model, node=head, path=str(tmp_path / "store-a"))
        d = _placed(model, head, worker)  # accepted: gpu-b has no copy but can download one
        rank = d.ranks.get()
        # The head never says "pre-flight" here: the rank stops right after preparing.
        with mock.patch("deployments.node.ranks._await", autospec=True, side_effect=ranks.Aborted("the deployment ended")):
            ranks.rank_run(rank.pk)
    copy = ModelCopy.objects.get(model=model, node=worker)
    assert copy.state == "ready" and copy.bytes_done == model.total_size > 0
    assert Path(copy.path).is_relative_to(tmp_path / "store-b")
    assert (Path(copy.path) / "config.json").read_bytes() == (tiny_model_files / "config.json").read_bytes()
    assert copy.path in d.events.get(step="prepare@gpu-b").message
    assert DeploymentRank.objects.get(pk=rank.pk).state == "stopped"
