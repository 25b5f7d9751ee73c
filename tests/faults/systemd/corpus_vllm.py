"""An engine double that holds the GPU log corpus, for hosts without a GPU (tests/faults/test_real_systemd.py runs it
under a real systemd): `vllm serve MODEL ...` first prints the recorded TP=8 GPU load that fake_engine.json's "replay"
names (tests/fixtures/gpu_logs/, at its "replay_speed"), then is tests/faults/fakevllm/vllm (its load log lines,
/health, its process group of two). Anything else (`--version`, `serve --help=all`, the fake's `_core` child) is the
fake's. tests/gpu/standin_vllm.py does the same on the GPU machine, with GPU memory held by torch.

Copied as `vllm` with the fake beside it as `fakevllm` (and fakeproto.py, serve-flags.txt) and tests/gpucorpus.py as
`gpucorpus.py`, into a folder the engine user can read. Standard library only: the container's own python3 runs it."""

import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _load(name: str, file: str):
    loader = importlib.machinery.SourceFileLoader(name, str(HERE / file))
    module = importlib.util.module_from_spec(
        importlib.util.spec_from_loader(name, loader)
    )
    loader.exec_module(module)
    return module


def main() -> None:
    argv = sys.argv[1:]
    if (
        argv[:1] == ["serve"]
        and len(argv) > 1
        and not any(a.startswith("--help") for a in argv)
    ):
        config = json.loads((Path(argv[1]) / "fake_engine.json").read_text())
        if config.get("replay"):
            _load("gpucorpus", "gpucorpus.py").replay(
                Path(config["replay"]), float(config.get("replay_speed", 1.0))
            )
    _load("fakevllm", "fakevllm").main()


if __name__ == "__main__":
    main()
