"""Download throughput of the panel's downloads.download against huggingface_hub.snapshot_download.

Both fetch the same ~1 GB repo from the same local Hub-compatible server (tests/hfserver.py, in its own
process, LFS files behind a cross-host redirect like the real Hub). The panel's time includes repo_info
and its extra work (sha256 of every byte, every file on disk before its atomic rename); snapshot_download
checks no hash and never fsyncs, so it finishes with its data still in the page cache.
After an untimed warm-up of each, runs alternate order; each side's best round counts.
Caveats: the dev machine has 2 cores, shared by the server's process, the client under test and whatever
else runs there; on loopback the disk, not the network, can bound a durable download.

Last line: panel_mb_s=... hf_mb_s=... ratio=...
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from huggingface_hub import snapshot_download  # noqa: E402

from deployments.host import downloads, hub  # noqa: E402

REPO = "perf/model"
MB = 1_000_000


def make_repo(root: Path, shard_mb: int, shards: int) -> int:
    """Write a repo of random safetensors shards plus small JSON files; return its size in bytes."""
    repo = root / REPO
    repo.mkdir(parents=True)
    block = bytearray(os.urandom(16 << 20))
    for i in range(shards):
        with open(repo / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            left = shard_mb * MB
            while left:
                block[:8] = os.urandom(8)  # every block differs, so no two files share content
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
    (repo / "config.json").write_text('{"model_type": "llama", "hidden_size": 4096}\n')
    (repo / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"}}\n' * 2000)
    return sum(p.stat().st_size for p in repo.iterdir())


def start_server(root: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "hfserver.py"), "--root", str(root)],
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if " on " not in line:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line.rsplit(" on ", 1)[1].strip()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_panel(url: str, dest: Path) -> None:
    info = hub.repo_info(REPO, endpoint=url)
    downloads.download(info, dest, endpoint=url)


def run_hf(url: str, dest: Path) -> None:
    snapshot_download(REPO, endpoint=url, cache_dir=str(dest), token=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard-mb", type=int, default=250)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tmp", default=None, help="where the repo and the downloads go (default: system temp)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="download-ratio-", dir=args.tmp) as tmp:
        tmp = Path(tmp)
        os.environ["HF_HOME"] = str(tmp / "hf-home")
        total = make_repo(tmp / "repos", args.shard_mb, args.shards)
        server, url = start_server(tmp / "repos")
        try:
            hub.repo_info(REPO, endpoint=url)  # the server hashes the repo on first sight; keep that out
            print(f"repo {REPO}: {total / MB:.0f} MB in {args.shards + 2} files; server {url}")
            best = {"panel": float("inf"), "hf": float("inf")}
            runners = {"panel": run_panel, "hf": run_hf}
            for name in ("panel", "hf"):  # warm-up, untimed: imports, connection pools, fresh page cache
                runners[name](url, tmp / "warm-up")
                shutil.rmtree(tmp / "warm-up")
            for rnd in range(args.rounds):
                order = ["panel", "hf"] if rnd % 2 == 0 else ["hf", "panel"]
                for name in order:
                    dest = tmp / f"{name}-{rnd}"
                    os.sync()  # start each run with a quiet disk: the repo just written, the last run's files
                    cpu0, t0 = cpu_seconds(), time.perf_counter()
                    runners[name](url, dest)
                    elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
                    best[name] = min(best[name], elapsed)
                    print(f"round {rnd + 1} {name:5s}: {elapsed:6.2f} s  {total / MB / elapsed:7.1f} MB/s  "
                          f"client CPU {cpu:5.2f} s")
                    shutil.rmtree(dest)
        finally:
            server.terminate()
            server.wait(10)
    panel, hf = total / MB / best["panel"], total / MB / best["hf"]
    print(f"best: panel {panel:.1f} MB/s, huggingface_hub {hf:.1f} MB/s")
    print(f"panel_mb_s={panel:.1f} hf_mb_s={hf:.1f} ratio={panel / hf:.3f}")


if __name__ == "__main__":
    main()
