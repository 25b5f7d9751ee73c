"""A Stop always wins, whatever moment it lands: queued, fetching the model, launching or loading. A real agent
runs each plan with the fake engine; the Stop comes through the service at a random moment after the deploy, many
times in a row. After each: the row is stopped, no engine of the model runs, nobody's processes are left, its port
is free. Before the fix, a Stop landing in the launch step read the row before the plan wrote the PID down: the
engine kept running and its port, and the row said "stopped"."""
import time

import pytest

from deployments.host import processes
from deployments.models import Deployment
from deployments.services import deploys
from tests.conftest import wait_until
from tests.truestate import COUNTS, add_fake_model, assert_true_state, deploy, engines_under, random_moment, set_load, settle

pytestmark = [pytest.mark.faults, pytest.mark.django_db(transaction=True)]
ROUNDS = 50


@pytest.mark.timeout(600)
def test_a_stop_at_any_moment_of_a_deploy_leaves_no_engine_and_a_true_row(fault_agent, fake_model):
    node = fault_agent.node
    set_load(fake_model, 0.3)
    model = add_fake_model(node, fake_model)
    landed, d = [], None
    for round_ in range(ROUNDS):
        d = deploy(model, node, name="stop-wins") if d is None else deploys.deployment_redeploy(
            Deployment.objects.get(pk=d.pk))
        # A third of the Stops at a random moment of the first 0.3 s (queued, the model), a third just after the
        # plan moved to starting (the launch), a third while it loads.
        after = WINDOWS[round_ % 3]
        if after:
            reached = wait_until(lambda: (r := Deployment.objects.get(pk=d.pk)).status in after | TERMINAL and r,
                                 timeout=60, interval=0.005, message=f"round {round_}: the plan to reach {sorted(after)}")
            assert reached.status in after, (round_, reached.status, reached.status_message)
        time.sleep(random_moment(0.0, 0.05 if after else 0.3))
        row = Deployment.objects.get(pk=d.pk)
        landed.append(row.status)
        if row.status in Deployment.ACTIVE and row.status != Deployment.Status.STOPPING:
            deploys.deployment_stop(row)
        settled = settle(d, timeout=60, states={"stopped", "failed"})
        assert settled.status == "stopped", (round_, settled.status, settled.status_message)
        wait_until(lambda: not engines_under(fake_model), timeout=15,
                   message=f"round {round_} (Stop sent while {landed[-1]}): the engine to be gone")
        assert_true_state(d, fake_model)
        assert processes.port_free("0.0.0.0", settled.port), f"round {round_}: port {settled.port} still taken"
        COUNTS["stops_mid_deploy"] += 1
    print(f"the plan's status when each Stop was sent: {landed}")
    assert {"starting", "loading"} <= set(landed), landed  # the windows the fix is about were hit


TERMINAL = {"stopped", "failed"}
WINDOWS = (None, {"starting", "loading", "ready"}, {"loading", "ready"})
