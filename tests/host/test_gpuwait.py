"""The wait for GPU memory before an engine starts, against the NVML double (tests/nvmldouble.py) with the real
wait: display servers (graphics processes, or processes named as one) are never waited for, and a stopped
process's memory that the driver hands back over time is waited for until it is back."""
import pytest

from deployments.host import gpu, gpuwait
from tests.nvmldouble import GIB, MIB, FakeGpu, FakeNvml, proc

XORG = 2**22 + 5  # above Linux's PID_MAX_LIMIT: never a live process of this machine
GNOME = 2**22 + 6


@pytest.fixture
def fake(monkeypatch):
    fake = FakeNvml([FakeGpu("GPU-aaaa", drain_s=1.0), FakeGpu("GPU-bbbb", drain_s=1.0)])
    for g in fake.gpus:
        g.used = 0  # an idle GPU reads 0 used beside its processes (v2, as on a real H100)
    monkeypatch.setattr(gpu, "pynvml", fake)
    monkeypatch.setattr(gpu, "_session", None)
    return fake


def test_a_display_server_holding_memory_is_not_waited_for(fake):
    fake.gpus[0].graphics = [proc(XORG, 512 * MIB)]
    fake.names[XORG] = "/usr/lib/xorg/Xorg"

    kept = gpuwait.wait_memory_released([0, 1], None, timeout_s=2, poll_s=0.01)

    assert [(k.index, k.pid, k.name, k.used_memory) for k in kept] == [(0, XORG, "Xorg", 512 * MIB)]
    assert gpu.processes_on([0])[0][0].pid == XORG  # untouched: still there, still holding its memory


def test_a_process_named_as_a_display_server_is_not_waited_for_even_when_listed_as_compute(fake):
    fake.gpus[1].compute = [proc(GNOME, 300 * MIB)]
    fake.names[GNOME] = "gnome-shell"

    kept = gpuwait.wait_memory_released([1], None, timeout_s=2, poll_s=0.01)

    assert [(k.pid, k.name) for k in kept] == [(GNOME, "gnome-shell")]


def test_a_compute_process_that_stays_times_out_naming_it_and_not_the_display_server(fake):
    fake.gpus[0].graphics = [proc(XORG, 512 * MIB)]
    fake.gpus[0].compute = [proc(4242, 8 * GIB)]

    with pytest.raises(gpu.MemoryNotReleased) as caught:
        gpuwait.wait_memory_released([0], None, timeout_s=0.05, poll_s=0.01)

    assert caught.value.pids_still_holding == {4242: 8 * GIB}


def test_the_stopped_process_memory_draining_over_time_is_waited_for(fake):
    fake.gpus[0].compute = [proc(4242, 40 * GIB)]
    fake.gpus[0].exits_after[4242] = 2  # gone from the lists after two reads, its memory back over a second

    gpuwait.wait_memory_released([0], [4242], timeout_s=10, poll_s=0.01)

    assert gpu.processes_on([0]) == {0: []}
    # Back when the wait ended (give or take what the wait lets go unexplained), not only gone from the list.
    assert gpu.sample([0])[0].memory_used <= gpuwait.UNEXPLAINED_BYTES


def test_draining_memory_beside_a_display_server_is_waited_for_and_the_display_servers_memory_stays(fake):
    fake.gpus[0].graphics = [proc(XORG, 512 * MIB)]
    fake.gpus[0].compute = [proc(4242, 40 * GIB)]
    fake.gpus[0].exits_after[4242] = 1

    gpuwait.wait_memory_released([0], None, timeout_s=10, poll_s=0.01)

    assert 512 * MIB <= gpu.sample([0])[0].memory_used <= 512 * MIB + gpuwait.UNEXPLAINED_BYTES


def test_memory_no_listed_process_explains_ends_the_wait_once_it_stops_falling(fake):
    fake.gpus[0].used = 6 * GIB  # held from another container: NVML lists no process for it

    gpuwait.wait_memory_released([0], None, timeout_s=10, poll_s=0.01)
