"""Fixtures for the end-to-end tests: a node agent with the real CPU vLLM engine."""
import shutil
from pathlib import Path

import pytest

from deployments.host import processes
from deployments.models import Deployment, ModelCopy, Node
from deployments.services import repos
from tests.conftest import VLLM, agent_argv, in_thread, wait_until

# How long e2e agents' smoke test waits for a just-loaded engine's first answer (PANEL_SMOKE_BOUND_S): the other test
# worker's engine shares the 2 cores (a CLI deploy gave up at 180 s), and a TP-2 engine's first answer over two nodes
# took over 180 s beside it.
SMOKE_BOUND_S = 420


@pytest.fixture
def stop_engines():
    """Engines run in their own sessions and outlive a killed agent: never leave one behind."""
    yield
    for pgid in Deployment.objects.exclude(pgid=None).values_list("pgid", flat=True):
        processes.stop(pgid, term_timeout_s=5, kill_timeout_s=5)


def start_cpu_node(process_env, spawn, unique, tmp_path, model_folder, **extra_env):
    """A real node agent with the CPU engine and `model_folder` as a ready local model: (node, model, agent env);
    without a folder, no model (None)."""
    assert VLLM.exists(), "scripts/install-engine installs the CPU engine"
    # CPU_HOST_EXCLUSIVE off: other test sessions on this shared machine run engines of their own
    # (tests/faults checks the whole-host claim with it on).
    env = dict(process_env, VLLM_BIN=str(VLLM), VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"), PANEL_VAR_DIR=str(tmp_path),
               CPU_HOST_EXCLUSIVE="0", PANEL_SMOKE_BOUND_S=str(SMOKE_BOUND_S), **extra_env)
    name = f"cpu-{unique}"
    spawn(agent_argv(name, tmp_path / "store", sample_seconds=1, heartbeat_seconds=2), env, name=name)
    node = wait_until(lambda: Node.objects.filter(name=name).first(), timeout=60, message="the agent")
    if model_folder is None:
        wait_until(lambda: Node.objects.get(pk=node.pk).engine_flags, timeout=120, message="the engine's flags")
        return node, None, env
    # A copy of its own: engines run in their model's folder, and what a test counts as its engine's processes
    # (tests/truestate.engines_under) is what runs there, never another test's engine serving the same files.
    # Made readable for the engine user whatever this process's umask (a test may have left it 077: CI once saw the
    # engine refused its model folder).
    own = tmp_path / "own-model"
    own.mkdir(exist_ok=True)
    own.chmod(0o755)
    model_folder = Path(shutil.copytree(model_folder, own / Path(model_folder).name))
    for path in [model_folder, *model_folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    model = in_thread(repos.model_add_local, node, str(model_folder))
    wait_until(lambda: ModelCopy.objects.filter(model=model, node=node, state="ready").exists(), timeout=60,
               message="the local model on the node")
    wait_until(lambda: Node.objects.get(pk=node.pk).engine_flags, timeout=120, message="the engine's flags")
    return node, model, env


@pytest.fixture
def cpu_node(process_env, spawn, unique, tmp_path, tiny_model):
    node, model, _ = start_cpu_node(process_env, spawn, unique, tmp_path, tiny_model)
    yield node, model
    # Engines run in their own sessions and outlive a killed agent: never leave one behind.
    for pgid in Deployment.objects.filter(node=node).exclude(pgid=None).values_list("pgid", flat=True):
        processes.stop(pgid, term_timeout_s=5, kill_timeout_s=5)


