"""The GPUs' idle draw before a run (benchmarks/energy.py), on an energy meter fed by a counter and a clock of the
test's own: a known draw is read back exactly; an engine that served someone meanwhile, or whose /metrics cannot be
read, gives no idle figure and says why; a node without counters says nothing."""
from types import SimpleNamespace
from unittest import mock

import pytest

from benchmarks import energy
from deployments.host import gpu, vllm

IDLE = {"num_requests_running": 0.0, "num_requests_waiting": 0.0, "generation_tokens_total": 7.0}


def _meter(watts: float):
    clock = SimpleNamespace(t=50.0)
    meter = gpu.EnergyMeter([0, 1], read=lambda indices: int(clock.t * watts * 1000))

    def wait(seconds):
        clock.t += seconds

    return meter, clock, wait


@pytest.fixture
def metrics():
    with mock.patch("benchmarks.energy.vllm.read_metrics") as read:
        yield read


def test_a_known_idle_draw_is_read_back(metrics):
    meter, clock, wait = _meter(180.0)
    metrics.return_value = IDLE
    with mock.patch("deployments.host.gpu.time", SimpleNamespace(monotonic=lambda: clock.t)):
        watts, why = energy.idle_watts(meter, "http://127.0.0.1:9", "", 5.0, sleep=wait)
    assert watts == pytest.approx(180.0) and why == ""
    assert energy.net_joules(1000.0, watts, 2.0) == pytest.approx(640.0)
    assert energy.net_joules(100.0, watts, 2.0) == 0.0, "never below nothing"
    assert energy.net_joules(None, watts, 2.0) is None and energy.net_joules(100.0, None, 2.0) is None


@pytest.mark.parametrize(("before", "after", "said"), [
    (IDLE, {**IDLE, "num_requests_running": 1.0}, energy.BUSY),
    ({**IDLE, "num_requests_waiting": 2.0}, IDLE, energy.BUSY),
    (IDLE, {**IDLE, "generation_tokens_total": 9.0}, energy.BUSY),  # a request came and went within the window
    (vllm.VllmError("refused"), IDLE, energy.UNREAD),
    (IDLE, {}, energy.UNREAD),  # not a vLLM /metrics page
])
def test_an_engine_not_provably_idle_gives_no_idle_figure_and_says_why(metrics, before, after, said):
    meter, clock, wait = _meter(180.0)
    metrics.side_effect = [before, after]
    with mock.patch("deployments.host.gpu.time", SimpleNamespace(monotonic=lambda: clock.t)):
        assert energy.idle_watts(meter, "http://127.0.0.1:9", "", 5.0, sleep=wait) == (None, said)


def test_a_node_without_energy_counters_or_a_zero_window_measures_nothing(metrics):
    slept = []
    assert energy.idle_watts(gpu.EnergyMeter([]), "http://x", "", 5.0, sleep=slept.append) == (None, "")
    meter, clock, wait = _meter(180.0)
    assert energy.idle_watts(meter, "http://x", "", 0, sleep=slept.append) == (None, "")
    assert slept == [] and not metrics.called
