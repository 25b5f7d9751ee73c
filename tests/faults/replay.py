"""Replayable fault moments. Each fault test draws its random moments (tests/truestate.random_moment) from an RNG
of its own, seeded from the run's base seed and the test's id: which xdist worker runs it, and what ran before it
there, changes nothing, so `FAULT_SEED=<base> ./panel test tests/faults -k <test>` replays one test's moments.

The base seed is FAULT_SEED when set. Otherwise the run draws one: the process that reads this module first at
pytest's start (a run of tests/faults or of a file in it: the controller, under xdist) draws it and exports it to
the workers it starts; where only the workers read it (the whole suite: tests/faults' conftest is loaded during
collection), each derives it from the run id that pytest-xdist gives all of them. A run of tests/faults prints it
in its header, and every fault test that fails prints it in its report, with the command that replays that test;
each test's --junitxml report holds the seed and the moments it drew (properties FAULT_SEED and fault_moments), to
compare a replay with. tests/faults/conftest.py takes the hooks and the fixture below."""
import os
import random
import shlex

import pytest

SEED_VAR = "FAULT_SEED"


def _base_seed() -> int:
    if os.environ.get(SEED_VAR):
        return int(os.environ[SEED_VAR])
    if run_id := os.environ.get("PYTEST_XDIST_TESTRUNUID"):  # the same in every worker of one run
        return int(run_id[:8], 16) % (2 ** 31 - 1) + 1
    return random.SystemRandom().randrange(1, 2 ** 31)


BASE_SEED = _base_seed()


def rng_of(nodeid: str, base: int | None = None) -> random.Random:
    """A fresh RNG for test `nodeid` from `base` (default: this run's base seed)."""
    return random.Random(f"{BASE_SEED if base is None else base}:{nodeid}")


class Moments:
    """A test's RNG and what it drew."""

    def __init__(self, nodeid: str):
        self.nodeid, self.rng, self.drawn = nodeid, rng_of(nodeid), []


_current: Moments | None = None


def moment(low: float, high: float) -> float:
    """A random moment in [low, high] from the running test's RNG. The fixture below starts every fault test's
    afresh; another test (tests/e2e's real-engine kill) gets its own, by its id, at its first draw."""
    global _current
    nodeid = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if not nodeid:
        raise RuntimeError("fault moments are drawn inside a test (PYTEST_CURRENT_TEST names it)")
    if _current is None or _current.nodeid != nodeid:
        _current = Moments(nodeid)
    value = _current.rng.uniform(low, high)
    _current.drawn.append(value)
    return value


def replay_line(nodeid: str) -> str:
    return (f"{SEED_VAR}={BASE_SEED}: this test's fault moments come from it; to replay them: "
            f"{SEED_VAR}={BASE_SEED} ./panel test {shlex.quote(nodeid)}")


def pytest_configure(config):
    """The first process to read this module fixes the base seed for the processes it starts (xdist's workers)."""
    os.environ.setdefault(SEED_VAR, str(BASE_SEED))


def pytest_report_header(config):
    return f"fault moments: {SEED_VAR}={BASE_SEED} (set it to replay them; each test draws from its own RNG)"


@pytest.fixture(autouse=True)
def fault_moments(request):
    """This test's RNG, fresh (a test run twice in one process draws the same moments twice); the base seed and the
    moments it drew go in its report (--junitxml's properties), so that a replay can be compared with the run."""
    global _current
    mine = _current = Moments(request.node.nodeid)
    request.node.user_properties.append((SEED_VAR, BASE_SEED))
    yield mine
    if mine.drawn:
        request.node.user_properties.append(("fault_moments", " ".join(f"{m:.6f}" for m in mine.drawn)))
    _current = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed fault test says how to replay it, under its failure."""
    report = yield
    if report.failed:
        report.sections.append(("fault moments", replay_line(item.nodeid)))
    return report
