"""The fault suite's random moments replay (tests/faults/replay.py): a test draws the same moments for the same base
seed whichever xdist worker runs it and whatever ran before it, the workers of one run share the base seed, and a
failing fault test prints the seed and the command that replays it. Shown with pytest itself, run on a sample
suite that takes tests/faults' hooks the way tests/faults/conftest.py does."""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT
from tests.faults import replay

SAMPLE_CONFTEST = """
from tests.faults.replay import fault_moments, pytest_configure, pytest_report_header, pytest_runtest_makereport
"""
SAMPLE_TESTS = """
import json, os
import pytest
from tests.truestate import random_moment

def record(request):
    moments = [random_moment(0.0, 10.0) for _ in range(3)]
    with open(os.environ["MOMENTS_OUT"], "a") as out:
        out.write(json.dumps({"test": request.node.nodeid, "seed": os.environ["FAULT_SEED"],
                              "worker": os.environ.get("PYTEST_XDIST_WORKER", "none"), "moments": moments}) + "\\n")
    return moments

def test_one(request):
    record(request)

def test_two(request):
    record(request)

@pytest.mark.parametrize("n", [1, 2])
def test_three(request, n):
    record(request)

def test_four_fails(request):
    assert not record(request), "a fault test's failure"
"""


def _sample(tmp_path):
    """tests/ with faults/ below it: a run of tests/faults loads the hooks at its start (the controller's header),
    a run of tests/ only in the workers' collection (the whole suite's shape)."""
    root = tmp_path / "sample"
    (root / "suite" / "faults").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "suite" / "faults" / "conftest.py").write_text(SAMPLE_CONFTEST)
    (root / "suite" / "faults" / "test_moments.py").write_text(SAMPLE_TESTS)
    return root


def _run(root, out, *args, seed=None):
    env = {k: v for k, v in os.environ.items() if k not in ("FAULT_SEED", "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST",
                                                              "PYTEST_XDIST_TESTRUNUID", "PYTEST_ADDOPTS")}
    # Only xdist of the installed plugins: hypothesis, schemathesis and faker alone cost seconds of CPU a process.
    env.update(PYTHONPATH=str(ROOT), MOMENTS_OUT=str(out), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               **({"FAULT_SEED": str(seed)} if seed else {}))
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-p", "no:cacheprovider",
                           "-c", str(root / "pytest.ini"), "--rootdir", str(root), *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False)
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return done.stdout + done.stderr, {r["test"]: r for r in records}


def test_a_fault_tests_moments_replay_under_any_worker_and_order_from_the_printed_seed(tmp_path):
    root = _sample(tmp_path)
    # The whole suite's shape: two workers, and only they load the hooks. They agree on one base seed, and the
    # failing test prints it with the command that replays it.
    output, first = _run(root, tmp_path / "first.jsonl", "-n", "2", "--dist", "worksteal", "suite")
    assert len(first) == 5, output
    assert {r["worker"] for r in first.values()} == {"gw0", "gw1"}, first  # both workers drew
    seeds = {r["seed"] for r in first.values()}
    assert len(seeds) == 1, f"the workers drew from different base seeds: {seeds}"
    [seed] = seeds
    failing = "suite/faults/test_moments.py::test_four_fails"
    assert f"FAULT_SEED={seed} ./panel test {failing}" in output, output

    # The replay: a run of the fault folder with that seed (its header prints it), the tests in the reverse order
    # and one left out, dealt out anew to two workers: each test draws the same moments as in the first run.
    ids = ["suite/faults/test_moments.py::test_three[2]", "suite/faults/test_moments.py::test_two", failing,
           "suite/faults/test_moments.py::test_three[1]"]
    output, again = _run(root, tmp_path / "again.jsonl", "-n", "2", "--dist", "worksteal", *ids, seed=seed)
    assert f"fault moments: FAULT_SEED={seed}" in output, output
    assert set(again) == set(ids), output
    assert {t: again[t]["moments"] for t in ids} == {t: first[t]["moments"] for t in ids}

    # A run of the fault folder with no seed given: the seed its header prints is the one its workers drew from.
    output, third = _run(root, tmp_path / "third.jsonl", "-n", "2", "--dist", "worksteal", "suite/faults")
    drawn = {r["seed"] for r in third.values()}
    assert {r["worker"] for r in third.values()} == {"gw0", "gw1"} and len(drawn) == 1, third
    assert f"fault moments: FAULT_SEED={drawn.pop()}" in output, output


def test_the_moments_depend_on_the_base_seed_and_the_test_id_only():
    """(So the equal moments above are the same seed and test replayed, not a fixed sequence.)"""
    a = [replay.rng_of("tests/faults/test_x.py::test_a", 7).random() for _ in range(3)]
    assert a == [replay.rng_of("tests/faults/test_x.py::test_a", 7).random() for _ in range(3)]
    assert a != [replay.rng_of("tests/faults/test_x.py::test_b", 7).random() for _ in range(3)]
    assert a != [replay.rng_of("tests/faults/test_x.py::test_a", 8).random() for _ in range(3)]


def test_a_test_without_the_fixture_draws_from_its_own_rng_by_its_id(monkeypatch):
    """(tests/e2e/test_engine_kill.py draws its kill's moment without tests/faults' fixture.)"""
    from tests.truestate import random_moment

    for nodeid in ("tests/e2e/test_x.py::test_a", "tests/e2e/test_x.py::test_b"):
        monkeypatch.setenv("PYTEST_CURRENT_TEST", f"{nodeid} (call)")
        expected = replay.rng_of(nodeid)
        assert [random_moment(1.0, 8.0) for _ in range(2)] == [expected.uniform(1.0, 8.0) for _ in range(2)]
