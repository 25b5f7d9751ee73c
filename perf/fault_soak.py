"""Fault soak: the fault suite (tests/faults/) at full size, where CI runs each fault a few times:
FAULT_KILLS agent SIGKILLs in each phase (mid-load, mid-stop, mid-download), FAULT_RACES
delete-versus-deploy races, Redis down for FAULT_OUTAGE_S seconds each time. Each round runs the
whole suite once with a fresh FAULT_SEED, the base from which every test seeds its own random moments
(tests/faults/replay.py): a failure is printed with the command that replays that one test's moments.
Every test checks the true state after each fault; afterwards the soak looks for what the rounds left:

- `leaked_engines`: live processes carrying the panel's engine marker that run under the rounds'
  temporary folders (every engine a test started runs in its model folder there);
- `leaked_shm`: fake-engine /dev/shm files (psm_fakevllm_<pid>_*) that appeared during the soak and
  whose engine is gone (host-wide: run it under the heavy-run lock, where no other suite starts them).

    flock /tmp/heavy.lock .venv/bin/python perf/fault_soak.py [--kills 10] [--races 10] [--outage-s 30] [--rounds 1]

Above the last line, the timings the tests measured and compare with nothing (their `figure`s, e.g. lost_halt_s: a
halt lost with the web process or flushed from Redis, Stop to engine gone through the re-drive), each as its median,
min and max over every round. Last line: kills, races, outages and the other injected totals (summed over rounds),
tests passed, failed and skipped, the leaks, the wall time and the load average before the run. A failed test's
name, message and replay command are printed above it. Uses DATABASE_URL when set (the PostgreSQL-only tests run
then), else SQLite.
"""
import argparse
import collections
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")
FAKE_SHM = re.compile(r"psm_fakevllm_(\d+)_[0-9a-f]+")


def run_round(args, seed: int, basetemp: Path, timings: dict) -> tuple[collections.Counter, collections.Counter,
                                                                      list[str]]:
    """One pytest run of tests/faults; returns the injected totals, the outcomes and the failures, and adds the tests'
    figures to `timings`."""
    env = dict(os.environ, FAULT_KILLS=str(args.kills), FAULT_RACES=str(args.races),
               FAULT_OUTAGE_S=str(args.outage_s), FAULT_SEED=str(seed))
    report = basetemp.parent / f"{basetemp.name}.xml"
    # (each test's timeout grows with its repetition count: no --timeout needed here)
    argv = [sys.executable, "-m", "panelctl.launcher", "test", "tests/faults", "-p", "no:cacheprovider",
            "--basetemp", str(basetemp), f"--junitxml={report}", *args.pytest_args]
    proc = subprocess.run(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(proc.stdout)
    injected = collections.Counter()
    for line in proc.stdout.splitlines():
        if line.startswith("faults: "):
            for item in line[len("faults: "):].split(", "):
                name, value = item.split("=")
                injected[name] += int(value)
    outcomes, failures = collections.Counter(), []
    if not report.exists():
        outcomes["failed"] += 1
        failures.append(f"pytest exited {proc.returncode} without a report")
        return injected, outcomes, failures
    for case in ET.parse(report).getroot().iter("testcase"):
        for prop in case.iter("property"):
            if prop.get("name") not in ("FAULT_SEED", "fault_moments"):
                timings.setdefault(prop.get("name"), []).append(float(prop.get("value")))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            outcomes["failed"] += 1
            nodeid = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
            failures.append(f"{nodeid}: {(bad.get('message') or '')[:300]} "
                            f"(replay: FAULT_SEED={seed} ./panel test {nodeid})")
        elif case.find("skipped") is not None:
            outcomes["skipped"] += 1
        else:
            outcomes["passed"] += 1
    return injected, outcomes, failures


def marked_engines_under(root: Path) -> list[int]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if b"PANEL_ENGINE=" in Path(f"/proc/{proc.pid}/environ").read_bytes() and proc.cwd().startswith(str(root)):
                found.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10, help="agent SIGKILLs per phase (CI: tests/faults' default)")
    parser.add_argument("--races", type=int, default=10, help="delete-versus-deploy races")
    parser.add_argument("--outage-s", type=float, default=30.0, help="seconds Redis stays down, each time")
    parser.add_argument("--rounds", type=int, default=1, help="runs of the whole suite, each with its own seed")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --), e.g. -k mid_load")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    shm_before = set(os.listdir(SHM))
    started = time.monotonic()
    injected, outcomes, failures, timings = collections.Counter(), collections.Counter(), [], {}
    with tempfile.TemporaryDirectory(prefix="fault-soak-") as tmp:
        for index in range(args.rounds):
            seed = random.SystemRandom().randrange(1, 2 ** 31)
            print(f"round {index + 1}/{args.rounds}: FAULT_SEED={seed}", flush=True)
            i, o, f = run_round(args, seed, Path(tmp) / f"round-{index}", timings)
            injected.update(i)
            outcomes.update(o)
            failures += [f"round {index + 1} (FAULT_SEED={seed}): {line}" for line in f]
        leaked_engines = marked_engines_under(Path(tmp))
    leaked_shm = sorted(n for n in set(os.listdir(SHM)) - shm_before
                        if (m := FAKE_SHM.fullmatch(n)) and not psutil.pid_exists(int(m[1])))
    for name, values in sorted(timings.items()):
        print(f"{name}: median {statistics.median(values):.2f} s, min {min(values):.2f}, max {max(values):.2f} "
              f"(n={len(values)})")
    for line in failures:
        print(f"FAILED {line}")
    if leaked_engines or leaked_shm:
        print(f"left behind: engine PIDs {leaked_engines}, /dev/shm files {leaked_shm}")
    figures = {
        "kills": sum(v for k, v in injected.items() if k.startswith("kills_")),
        "agent_sigkills": injected["agent_sigkills"],
        "races": injected["delete_deploy_races"],
        "outages": injected["redis_outages"],
        **{k: v for k, v in sorted(injected.items())
           if not k.startswith("kills_") and k not in ("agent_sigkills", "delete_deploy_races", "redis_outages")},
        "passed": outcomes["passed"], "failed": outcomes["failed"], "skipped": outcomes["skipped"],
        "leaked_engines": len(leaked_engines), "leaked_shm": len(leaked_shm),
        "rounds": args.rounds, "wall_s": round(time.monotonic() - started, 1), "load_before": round(load_before, 2),
    }
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 1 if outcomes["failed"] or leaked_engines or leaked_shm else 0


if __name__ == "__main__":
    sys.exit(main())
