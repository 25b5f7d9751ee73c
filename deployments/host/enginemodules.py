"""Optional packages that a `vllm serve` flag needs and vLLM does not install with itself, checked against the
engine's own Python before a launch: without them vLLM fails only once it reaches the weights (after the model
store, the KV-cache plans and a stopped predecessor; for a large model half an hour in). Plain Python, no Django.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

from deployments.host import processenv

# (flag, value) -> the module vLLM imports for it. From vLLM's own imports: weight_utils.py
# (`from fastsafetensors import ...`, `import instanttensor`, `from runai_model_streamer import SafetensorsStreamer`),
# tensorizer.py (`from tensorizer import ...`) and the bitsandbytes quantizer and loader (`import bitsandbytes`).
NEEDS = {
    ("load-format", "fastsafetensors"): "fastsafetensors",
    ("load-format", "instanttensor"): "instanttensor",
    ("load-format", "runai_streamer"): "runai_model_streamer",
    ("load-format", "runai_streamer_sharded"): "runai_model_streamer",
    ("load-format", "tensorizer"): "tensorizer",
    ("load-format", "bitsandbytes"): "bitsandbytes",
    ("quantization", "bitsandbytes"): "bitsandbytes",
}
MODULES = sorted(set(NEEDS.values()))
# The pip name where it is not the module's.
PACKAGES = {"runai_model_streamer": "runai-model-streamer"}
# Which of the modules the interpreter finds, without importing them (find_spec reads no package's code).
_PROBE = "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m)))"


def interpreter(vllm_bin: str, environ: dict | None = None) -> str | None:
    """The Python the `vllm` script runs under: its `#!` line's (a `/usr/bin/env python3` one found on the engine's
    PATH), or the one pip's `#!/bin/sh` wrapper for long paths execs; None for anything else."""
    try:
        with open(vllm_bin, "rb") as f:
            head = f.read(1024).decode(errors="replace").splitlines()[:3]
    except OSError:
        return None
    first = head[0].strip() if head else ""
    if found := re.match(r"^#!\s*(/\S*/python[0-9.]*)$", first):
        python = found[1]
    elif found := re.match(r"^#!\s*/usr/bin/env\s+(python[0-9.]*)$", first):
        python = shutil.which(found[1], path=(environ or processenv.engine_environ({})).get("PATH"))
    elif first == "#!/bin/sh" and len(head) > 1 and (found := re.match(r"^'''exec' (\S*python[0-9.]*) ", head[1])):
        python = found[1].strip("'\"")
    else:
        return None
    return python if python and os.access(python, os.X_OK) else None


def importable(vllm_bin: str, timeout_s: float = 60.0) -> tuple[str, set[str]] | None:
    """(the engine's Python, which of MODULES it can import), or None when that cannot be told. Asked each time:
    a package installed into the engine's environment counts at the next deploy, without restarting the agent."""
    environ = processenv.engine_environ({})
    python = interpreter(vllm_bin, environ)
    if python is None:
        return None
    try:
        out = subprocess.run([python, "-c", _PROBE, *MODULES], capture_output=True, text=True, timeout=timeout_s,
                             env=environ, stdin=subprocess.DEVNULL)
    except (subprocess.TimeoutExpired, OSError):
        return None
    return (python, set(out.stdout.split()) & set(MODULES)) if out.returncode == 0 else None


def needed(engine_args: dict) -> list[tuple[str, str]]:
    """("--load-format fastsafetensors", "fastsafetensors") for each of `engine_args` (canonical) that needs one."""
    return [(f"--{flag} {engine_args[flag]}", module) for (flag, value), module in NEEDS.items()
            if str(engine_args.get(flag, "")).lower() == value]


def refusal(flag: str, module: str, python: str) -> str:
    package = PACKAGES.get(module, module)
    return (f"{flag} needs the Python package {package}, which the engine's Python ({python}) cannot import. "
            f"To fix it, install it into the engine's environment (`{python} -m pip install {package}`), "
            f"or deploy without {flag}")


def refusals(engine_args: dict, found: tuple[str, set[str]] | None) -> list[str]:
    """A refusal for each flag whose package the engine's Python lacks, by `found` (importable's answer; None: not
    known, nothing refused: the engine then says so itself)."""
    if found is None:
        return []
    python, present = found
    return [refusal(flag, module, python) for flag, module in needed(engine_args) if module not in present]


def missing(engine_args: dict, vllm_bin: str) -> list[str]:
    """refusals() asked of the engine now, only when a flag needs a package (on the node, before a launch)."""
    return refusals(engine_args, importable(vllm_bin)) if needed(engine_args) else []


def report(vllm_bin: str) -> dict:
    """What the node records of its engine (Node.engine_modules): {"python", "present"}, or {} when not known."""
    found = importable(vllm_bin)
    return {"python": found[0], "present": sorted(found[1])} if found else {}


def recorded(report: dict | None) -> tuple[str, set[str]] | None:
    """A recorded report() as importable's answer, for the panel's own check of a deploy."""
    return (report["python"], set(report["present"])) if report else None
