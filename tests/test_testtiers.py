"""The test tiers docs/testing.md names: `./panel test --fast` selects by marker, CI lists the slowest tests."""
from controlpanel import launcher


def test_the_fast_tier_leaves_out_every_test_that_needs_an_engine_browser_or_killed_process():
    argv = launcher.pytest_argv(["--fast", "-x", "tests/host"], ci=False)
    assert argv[argv.index("-m") + 1] == launcher.FAST_MARKERS and argv[-2:] == ["-x", "tests/host"]
    for marker in ("e2e", "faults", "integration", "slow", "gpu"):
        assert f"not {marker}" in launcher.FAST_MARKERS


def test_ci_prints_the_thirty_slowest_tests_and_a_developer_run_does_not():
    assert "--durations=30" in launcher.pytest_argv([], ci=True)
    assert not any(a.startswith("--durations") for a in launcher.pytest_argv(["-k", "x"], ci=False))
    assert "-m" not in launcher.pytest_argv(["tests/e2e"], ci=True)  # the whole suite filters nothing


def test_the_suite_runs_on_two_workers_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("PANEL_TEST_WORKERS", raising=False)
    argv = launcher.pytest_argv([], ci=True)
    assert argv[argv.index("-n") + 1] == "2" and argv[argv.index("--dist") + 1] == "worksteal"
    assert launcher.pytest_argv(["-n", "0", "tests/host"], ci=False) == ["-n", "0", "tests/host"]
    monkeypatch.setenv("PANEL_TEST_WORKERS", "3")
    assert launcher.pytest_argv([], ci=False)[:2] == ["-n", "3"]


class _Item:
    def __init__(self, name, marker=None):
        self.name, self.marker = name, marker

    def get_closest_marker(self, name):
        return name if name == self.marker else None


def test_each_worker_starts_on_its_share_of_the_long_tests_and_short_ones_fill_up_to_equal_parts():
    from tests.conftest import _lanes

    items = [_Item(f"fast{i}") for i in range(6)] + [_Item("e2e-a", "e2e"), _Item("slow-a", "slow"),
                                                      _Item("e2e-b", "e2e"), _Item("faults-a", "faults")]
    order = [i.name for i in _lanes(items, 2)]
    assert order == ["slow-a", "e2e-b", "fast0", "fast1", "fast2", "e2e-a", "faults-a", "fast3", "fast4", "fast5"]
    assert [i.name for i in _lanes(items, 1)][:4] == ["slow-a", "e2e-a", "e2e-b", "faults-a"]
    assert sorted(i.name for i in _lanes(items, 3)) == sorted(i.name for i in items)
