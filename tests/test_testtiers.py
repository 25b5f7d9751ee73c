"""The test tiers docs/testing.md names: `./panel test --fast` selects by marker, CI lists the slowest tests."""
import tempfile

from panelctl import launcher


def test_the_fast_tier_leaves_out_every_test_that_needs_an_engine_browser_or_killed_process():
    argv = launcher.pytest_argv(["--fast", "-x", "tests/host"], ci=False)
    assert argv[argv.index("-m") + 1] == launcher.FAST_MARKERS and argv[-2:] == ["-x", "tests/host"]
    for marker in ("e2e", "faults", "integration", "slow", "gpu"):
        assert f"not {marker}" in launcher.FAST_MARKERS


def test_ci_prints_the_thirty_slowest_tests_and_a_developer_run_does_not():
    assert "--durations=30" in launcher.pytest_argv([], ci=True)
    assert not any(a.startswith("--durations") for a in launcher.pytest_argv(["-k", "x"], ci=False))
    assert "-m" not in launcher.pytest_argv(["tests/e2e"], ci=True)  # the whole suite filters nothing


def test_each_checkout_keeps_its_temporary_files_where_no_other_pytest_run_closes_them(tmp_path):
    """pytest makes its shared /tmp/pytest-of-<user> 0700 at every run's start: a run beside ours shut the engine
    user out of our tests' model folders. A checkout's own folder, named by its path, unless one is given."""
    ours = launcher.basetemp()
    assert "/pytest-of-" not in ours and ours.startswith(tempfile.gettempdir())
    assert f"--basetemp={ours}" in launcher.pytest_argv(["--fast"], ci=True)
    assert launcher.pytest_argv([f"--basetemp={tmp_path}"], ci=False).count(f"--basetemp={tmp_path}") == 1
    assert not [a for a in launcher.pytest_argv([f"--basetemp={tmp_path}"], ci=False) if a == f"--basetemp={ours}"]
    assert _basetemp_of(launcher.BASE_DIR.parent / "another-clone") != ours  # a second clone: a folder of its own


def _basetemp_of(root):
    import unittest.mock

    with unittest.mock.patch.object(launcher, "BASE_DIR", root):
        return launcher.basetemp()


def test_the_suite_runs_on_two_workers_and_the_fast_tier_on_three_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("PANEL_TEST_WORKERS", raising=False)
    argv = launcher.pytest_argv([], ci=True)
    assert argv[argv.index("-n") + 1] == "2" and argv[argv.index("--dist") + 1] == "worksteal"
    assert launcher.pytest_argv(["-n", "0", "tests/host"], ci=False) == [
        f"--basetemp={launcher.basetemp()}", "-n", "0", "tests/host"]
    fast = launcher.pytest_argv(["--fast"], ci=False)
    assert fast[fast.index("-n") + 1] == "3"  # the fast tier's tests wait more than they compute
    monkeypatch.setenv("PANEL_TEST_WORKERS", "3")
    assert launcher.pytest_argv([], ci=False)[:2] == ["-n", "3"]
    monkeypatch.setenv("PANEL_TEST_WORKERS", "2")
    fast = launcher.pytest_argv(["--fast"], ci=False)
    assert fast[fast.index("-n") + 1] == "2"


class _Mark:
    def __init__(self, *args):
        self.args = args


class _Item:
    def __init__(self, name, marker=None, module="m", exclusive=None, alone=False, engine=False):
        self.name, self.marker, self.path, self.exclusive = name, marker, f"tests/{module}.py", exclusive
        self.alone, self.fixturenames = alone, ["tiny_model"] if engine else []

    def get_closest_marker(self, name):
        if name == "exclusive":
            return _Mark(self.exclusive) if self.exclusive else None
        if name == "alone":
            return _Mark() if self.alone else None
        return name if name == self.marker else None


def test_each_worker_starts_on_its_share_of_the_long_tests_and_short_ones_fill_up_to_equal_parts():
    from tests.conftest import _lanes

    items = [_Item(f"fast{i}") for i in range(6)] + [
        _Item("e2e-a", "e2e", "a"), _Item("slow-a", "slow", "a"), _Item("e2e-b", "e2e", "b"),
        _Item("faults-c", "faults", "c")]
    order = [i.name for i in _lanes(items, 2)]
    # Module a (a slow test and an end-to-end one) on one worker, b and c on the other, each filled up to 5.
    assert order == ["slow-a", "e2e-a", "fast0", "fast1", "fast2", "e2e-b", "faults-c", "fast3", "fast4", "fast5"]
    assert [i.name for i in _lanes(items, 1)][:4] == ["slow-a", "e2e-a", "e2e-b", "faults-c"]
    assert sorted(i.name for i in _lanes(items, 3)) == sorted(i.name for i in items)


def test_tests_that_may_not_run_at_once_share_a_worker_and_the_long_work_is_balanced():
    """Two modules marked exclusive("clusters") on different workers would reach each other's lock together and
    one worker would wait idle: they go to one worker, and the other gets the rest of the long work."""
    from tests.conftest import _lanes

    items = [_Item("tp", "slow", "multinode", "clusters"), _Item("dp", "slow", "multinode", "clusters"),
             _Item("ray", "slow", "ray", "clusters"), _Item("hour", "slow", "hour"), _Item("tune", "slow", "tune"),
             _Item("cli", "slow", "cli"), _Item("deploy", "e2e", "deploy")]
    order = [i.name for i in _lanes(items, 2)]
    first, second = order[:4], order[4:]
    clusters = {"tp", "dp", "ray"}
    assert clusters <= set(first) or clusters <= set(second), order
    assert {len(first), len(second)} == {3, 4} and order.index("tp") + 1 == order.index("dp")  # modules whole


def test_a_test_that_must_run_alone_goes_first_while_the_other_worker_starts_without_an_engine():
    """An `alone` test waits for every other engine to end: first on worker 0 while worker 1 begins with tests that
    start none, nobody waits."""
    from tests.conftest import _lanes

    items = [_Item("kill", "e2e", "kill", alone=True, engine=True), _Item("a", "slow", "a", engine=True),
             _Item("b", "slow", "b"), _Item("c", "slow", "c"), _Item("d", "slow", "d", engine=True)]
    order = [i.name for i in _lanes(items, 2)]
    # kill, then the heaviest groups balanced; the second worker's engine-free c before its engine test a.
    assert order == ["kill", "b", "d", "c", "a"], order
