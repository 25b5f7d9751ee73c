"""The launcher's children started again with backoff (panelctl/launcher.py Children.restart_exited), on real
processes and the launcher's own clock: 1 s, doubled at each exit, back to 1 s after a minute up."""
import sys

from panelctl import launcher


def test_a_child_that_dies_is_started_again_after_its_delay_which_doubles_and_resets_after_a_minute_up():
    children = launcher.Children()
    first = children.start("agent", [sys.executable, "-c", "raise SystemExit(9)"], {})
    first.wait(10)
    t0 = children.started["agent"]
    try:
        assert children.restart_exited(t0 + 0.1) == ["agent exited with code 9; starting it again in 1 s (the rest "
                                                     "of the panel keeps running)."]
        assert children.restart_exited(t0 + 0.5) == []  # not yet due: nothing started, nothing said again
        said = children.restart_exited(t0 + 1.2)
        second = children.procs[0][1]
        assert second is not first and said == [f"agent started again (PID {second.pid})."]
        second.wait(10)
        assert children.restart_exited(t0 + 1.3)[0].endswith("starting it again in 2 s (the rest of the panel keeps running).")
        children.restart_exited(t0 + 3.4)
        third = children.procs[0][1]
        third.wait(10)
        assert children.restart_exited(t0 + 3.5)[0].endswith("in 4 s (the rest of the panel keeps running).")
        children.restart_exited(t0 + 7.6)
        children.procs[0][1].wait(10)
        up_a_minute = children.started["agent"] + launcher.RESTART_RESET_S
        assert children.restart_exited(up_a_minute)[0].endswith("in 1 s (the rest of the panel keeps running).")
    finally:
        children.stop(timeout=1)
