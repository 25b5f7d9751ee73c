"""SIGKILL the node agent while the real CPU vLLM loads: the restarted agent follows the load to the
end, and the true state checks (tests/truestate.py) hold, /dev/shm included: the real engine's own
files, held while it serves, are gone once it is stopped."""
import shutil
import time
from pathlib import Path

import pytest

from deployments.models import Deployment
from deployments.services import deploys
from tests import truestate
from tests.conftest import VLLM, free_port, wait_until
from tests.truestate import (COUNTS, Agent, add_fake_model, agent_env, assert_true_state, random_moment, settle,
                             stop_and_check)

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def shm_watch():
    """Files with the real engine's /dev/shm names count as this test's once they appear: the test runs
    `alone` (no other test of the run starts a real engine meanwhile) and CI runs one suite at a time."""
    truestate.WATCH = truestate.ShmWatch(real_names=True)
    yield truestate.WATCH
    truestate.WATCH = None


@pytest.mark.slow
@pytest.mark.alone
@pytest.mark.timeout(900)
def test_agent_killed_while_the_real_engine_loads_adopts_it_and_stops_it_clean(process_env, spawn, unique, tmp_path,
                                                                                tiny_model, shm_watch):
    """The real engine's load takes 20-60 s on 2 shared cores (4 min seen next to other engines), then a stop."""
    tiny_model = Path(shutil.copytree(tiny_model, tmp_path / "tiny-model"))  # engines run in their model's folder
    assert VLLM.exists(), "scripts/install-engine installs the CPU engine"
    env = agent_env(process_env, tmp_path, VLLM_BIN=VLLM, VLLM_CACHE_ROOT=tmp_path / "vllm-cache")
    agent = Agent(spawn, env, f"real-{unique}", tmp_path / "store")
    node = agent.start()
    try:
        wait_until(lambda: type(node).objects.get(pk=node.pk).engine_flags, timeout=120, message="the engine's flags")
        model = add_fake_model(node, tiny_model)
        d = deploys.deployment_create(model=model, node=node, gpu_indices=[], port=free_port(),
                                      env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"},
                                      engine_args={"enforce-eager": True, "max-model-len": 2048})
        wait_until(lambda: Deployment.objects.get(pk=d.pk).status == "loading", timeout=120,
                   message="the real engine to load")
        wait_until(lambda: truestate.engines_under(tiny_model), timeout=60, message="the engine process")
        time.sleep(random_moment(1.0, 8.0))  # the kill's moment, at random within the load: not a wait for anything
        agent.restart()
        # Alone, a load takes 20-60 s; next to other engines on 2 shared cores it was seen taking 4 min.
        row = settle(d, timeout=600, states={"ready", "failed"})
        assert row.status == "ready", row.status_message  # the restarted agent followed the load to the end
        assert_true_state(d, tiny_model)
        held = {p for p in shm_watch.seen if truestate.REAL_SHM.fullmatch(Path(p).name)}
        assert held, f"the serving engine holds no /dev/shm file named like {truestate.REAL_SHM.pattern}"
        print(f"the engine's /dev/shm files: {sorted(shm_watch.seen)}")
        stop_and_check(d, tiny_model, timeout=60)
        assert not [p for p in held if Path(p).exists()], "the engine's /dev/shm files are left after the stop"
        COUNTS["kills_mid_load_real_engine"] += 1
    finally:
        truestate.stop_leftover_engines(tmp_path)
