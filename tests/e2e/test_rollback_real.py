"""Versions and rollback with the real CPU engine and a real node agent: a deploy that reaches ready is version 1, known
good; a redeploy with flags vLLM refuses at launch (`--max-num-batched-tokens 2` below `--max-num-seqs 4`: its
scheduler config wants at least one token per sequence, a relation between two flags the panel does not check) fails
as version 2 with the engine's reason; Roll back to known good through the API deploys version 1 again, and the new
engine runs with exactly the first one's argv, read from /proc/<pid>/cmdline."""
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from deployments import versions
from deployments.models import Deployment
from deployments.services import deploys
from tests.conftest import free_port, in_thread, wait_until
from tests.factories import UserFactory

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
LOAD_S = 600  # a CPU engine starts in 20-70 s on 2 shared cores, minutes beside other engines


def _settled(d: Deployment, states=("ready", "failed")) -> Deployment:
    return wait_until(lambda: (row := Deployment.objects.get(pk=d.pk)).status in states and row, LOAD_S,
                      message=f"{d.name} to be {' or '.join(states)}")


def _argv(d: Deployment) -> list[str]:
    return Path(f"/proc/{d.pid}/cmdline").read_bytes().decode().split("\0")[:-1]


@pytest.mark.slow
def test_a_failed_redeploy_rolls_back_to_the_known_good_version_with_its_exact_argv(cpu_node, unique):
    """Slow: two real engine loads (20-70 s each on 2 shared cores) and a launch that fails."""
    node, model = cpu_node
    args = {"enforce-eager": True, "max-model-len": 2048, "max-num-seqs": 4, "served-model-name": "tiny"}
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    d = in_thread(deploys.deployment_create, model=model, node=node, gpu_indices=[], port=free_port(),
                  name=f"rollback-{unique}", engine_args=args, env=env)
    row = _settled(d)
    assert row.status == "ready", row.status_message
    first = _argv(row)

    in_thread(deploys.deployment_redeploy, row, engine_args={**args, "max-num-batched-tokens": 2}, env=env)
    row = _settled(d, ("failed",))
    v2 = d.versions.get(number=2)
    assert v2.outcome == "failed" and v2.outcome_message == row.status_message and v2.outcome_message
    assert versions.listed(row)[0]["changes"] == ["--max-num-batched-tokens 2 added"]

    api = APIClient()
    api.force_authenticate(UserFactory(role="operator"))
    answer = in_thread(api.post, f"/api/deployments/{d.pk}/rollback/", {}, format="json")
    assert answer.status_code == 202, answer.content
    row = _settled(d, ("ready",))
    assert _argv(row) == first, (first, _argv(row))
    v3 = d.versions.get(number=3)
    assert (v3.reason, v3.outcome, v3.request) == ("rollback to version 1", "ready", d.versions.get(number=1).request)
    listed = in_thread(api.get, f"/api/deployments/{d.pk}/versions/").json()["results"]
    assert [(v["number"], v["outcome"], v["known_good"]) for v in listed] == [
        (3, "ready", True), (2, "failed", False), (1, "ready", False)]
    print(f"\nv1 ready in {d.versions.get(number=1).ready_seconds:.0f} s; v2 failed: {v2.outcome_message[:200]}; "
          f"v3 (rollback) ready in {v3.ready_seconds:.0f} s with v1's argv")
    in_thread(deploys.deployment_stop, row)
    _settled(d, ("stopped",))
