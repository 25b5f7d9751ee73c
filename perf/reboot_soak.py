"""Reboot soak: tests/faults/test_reboot.py at full size (FAULT_REBOOTS=10 reboots at random moments, alternating
units-before-agent and agent-before-units), under the heavy-run lock. Prints the counts of reboots and crashes
survived (the test fails on the first deployment that does not come back ready with exactly one adopted engine).

    .venv/bin/python perf/reboot_soak.py [REBOOTS]"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    reboots = sys.argv[1] if len(sys.argv) > 1 else "10"
    env = dict(os.environ, FAULT_REBOOTS=reboots)
    argv = ["flock", "/tmp/heavy.lock", str(ROOT / ".venv/bin/python"), "-m", "panelctl.launcher", "test",
            "tests/faults/test_reboot.py", "-q", "-p", "no:randomly"]
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    print(out.stdout[-2000:])
    print(f"reboots asked: {reboots}; result: {'all survived' if out.returncode == 0 else 'FAILED'}")
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
