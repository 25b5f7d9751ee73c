"""The seed day rehearsed at full size: tests/e2e/test_seed_rehearsal.py with REHEARSAL_SIZE=full (64 shards of real
bytes at whatever size the disk allows, up to 256 MB each; the 36-minute GPU log corpus replayed at 1x; 2,000-token
reasoning answers to c=1,024; 3 repeats of the NCCL study; a 65 s stall in the download), under the heavy-run lock.
Prints the day as the test logs it (each step's wall time and what the panel said) and the figures:

  step_s[...]          each step's wall time (the download's, the load's, the benchmark's, the study's, the reboot's)
  day_s                the whole day
  load_phases          the load phases the API showed, in order; eta_first_s / eta_last_s the time left it showed
  download_mb, retries the copy's size and the retries its faults cost
  bench[c=N]           output tok/s, TTFT median and requests at each level (timeouts must be 0)
  study[VARIANT, c=N]  the variant against the baseline: output tok/s difference, its interval and the verdict

    .venv/bin/python perf/seed_rehearsal.py [--shard-mb MB] [--speed X] [--max-tokens N] [--postgres]

--speed replays the corpus faster (a moderate run: --shard-mb 16 --speed 20); --postgres runs it on the
PostgreSQL of DATABASE_URL (default: SQLite)."""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARDS = 64


def shard_mb_the_disk_allows(cap_mb: int = 256) -> int:
    """Each shard's size: the Hub double's folder and the node's copy (2 x 64 shards) in half the free disk."""
    free = shutil.disk_usage(tempfile.gettempdir()).free
    return max(1, min(cap_mb, int(free * 0.5 / (2 * SHARDS) / 2**20)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard-mb", type=float, default=None)
    parser.add_argument("--speed", type=float, default=1.0, help="the corpus's replay speed (1: as recorded)")
    parser.add_argument("--max-tokens", type=int, default=None, help="each answer's tokens (default 2,048)")
    parser.add_argument("--postgres", action="store_true")
    args = parser.parse_args()
    shard_mb = args.shard_mb or shard_mb_the_disk_allows()
    env = dict(
        os.environ,
        REHEARSAL_SIZE="full",
        REHEARSAL_SHARD_MB=str(shard_mb),
        REHEARSAL_SPEED=str(args.speed),
        PYTHONPATH=str(ROOT),
    )
    if args.max_tokens:
        env["REHEARSAL_MAX_TOKENS"] = str(args.max_tokens)
    if not args.postgres:
        env.pop("DATABASE_URL", None)
    argv = [
        "flock",
        "/tmp/heavy.lock",
        str(ROOT / ".venv/bin/python"),
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
        "-s",
        "tests/e2e/test_seed_rehearsal.py",
        f"--basetemp={tempfile.mkdtemp(prefix='seed-day-')}",
    ]
    print(
        f"shards: {SHARDS} x {shard_mb:g} MB; corpus at {args.speed:g}x; database: "
        f"{'PostgreSQL' if args.postgres else 'SQLite'}",
        flush=True,
    )
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    day = [line for line in out.stdout.splitlines() if re.match(r"^(== |   \S|\S.* {2,}[\d.]+ s$)", line)]
    print("\n".join(day))
    figures(day)
    print(f"result: {'passed' if out.returncode == 0 else 'FAILED'}")
    if out.returncode:
        print(out.stdout[-6000:], out.stderr[-3000:], sep="\n")
    return out.returncode


def figures(day: list[str]) -> None:
    """The figures from the day's log: step times, the load's phases and ETA, the benchmark's levels."""
    for line in day:
        if m := re.match(r"^   (?!panel: )(.+): ([\d.]+) s$", line):
            print(f"step_s[{m[1]}] = {m[2]}")
        elif m := re.match(r"^the whole day\s+([\d.]+) s$", line):
            print(f"day_s = {m[1]}")
        elif m := re.search(r"phases seen: (.+); ETA (\d+) s \.\. (\d+) s", line):
            print(f"load_phases = {m[1]}\neta_first_s = {m[2]}\neta_last_s = {m[3]}")
        elif m := re.search(r"panel: ([\d.]+) MB in \d+ shards, ready; (\d+) retries", line):
            print(f"download_mb = {m[1]}\nretries = {m[2]}")
        elif m := re.search(r"panel: c=(\d+): (\d+) requests, (\d+) tok/s out, TTFT median ([\d.]+) ms", line):
            print(f"bench[c={m[1]}] = {m[3]} tok/s out, TTFT median {m[4]} ms, {m[2]} requests")
        elif m := re.search(r"panel: (NCCL_ALGO=\w+) against the baseline, output tok/s at c=(\d+): (.+)$", line):
            print(f"study[{m[1]}, c={m[2]}] = {m[3]}")
        elif m := re.search(r"panel: winner: (.+)$", line):
            print(f"study_winner = {m[1]}")


if __name__ == "__main__":
    sys.exit(main())
