"""The engine's command line: the `vllm serve` argv built from a deployment's engine args, and the
flags and version the installed vLLM reports (cached per binary). Plain Python, no Django.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

from deployments import flagpolicy
from deployments.host import processenv
from deployments.host.processes import EngineError

# Where every engine's API server listens: loopback only. The node's gateway is the one door
# callers use (it checks their keys and forwards only the OpenAI API); a multi-node deployment's cluster
# ports are on the node's cluster address (node/cluster.py), never the API.
API_HOST = "127.0.0.1"
KEY_BY_PANEL = ("set by the panel (every engine gets a random key of its own); callers use keys of the node's "
                "gateway instead (made on the account page or with `panelctl keys create`)")
# Worded so that no word follows the flag: log and status redaction (deployments/secrets.py) masks the word after
# a secret-looking flag.
KEY_REFUSED = f"The engine's key (--api-key, VLLM_API_KEY) is {KEY_BY_PANEL}"
# The panel sets these itself; the deploy form and API refuse them too (userflags.check_flags).
RESERVED_FLAGS = {"--host": "set by the panel (engines listen on 127.0.0.1; the node's gateway is the public door)",
                  "--port": "set by the panel (the deployment's port)",
                  "--model": "set by the panel from the model",
                  "--api-key": KEY_BY_PANEL,
                  "--allowed-media-domains": "set by the panel from the route's media domains (the gateway "
                                             "checks the same list)"}


def reserved(flag: str) -> str:
    """Why `flag` (in RESERVED_FLAGS) is refused, as one sentence."""
    return KEY_REFUSED if flag == "--api-key" else f"{flag} is {RESERVED_FLAGS[flag]}"


def _word(name: str, value) -> str:
    """One value as an argv word; the last check that no value is read as another flag (flagpolicy)."""
    if problem := flagpolicy.value_problem(value, argv_only=True):
        raise EngineError(f"--{name}: {problem}", permanent=True)
    return str(value)


def build_argv(vllm_bin: str, model_path: str, port: int, host: str, engine_args: dict,
               panel_args: dict | None = None) -> list[str]:
    """Turn {"tensor-parallel-size": 8, "enforce-eager": True} into a `vllm serve` argv (no shell); `panel_args`:
    flags the panel itself sets (reserved ones among them: --allowed-media-domains), after the user's.

    Names must be canonical (flagpolicy.canonical_flags: `tensor-parallel-size`, never `tensor_parallel_size`
    or `--tensor-parallel-size`) and no value may begin with '-': every way in canonicalises and checks first,
    so anything else here is refused rather than guessed at."""
    argv = [str(vllm_bin), "serve", str(model_path), "--host", host, "--port", str(int(port))]
    for name, value in [*engine_args.items(), *(panel_args or {}).items()]:
        if not flagpolicy.is_canonical(name):
            raise EngineError(f"engine flag {str(name)[:40]!r} is not in canonical form (lower case, dashed, no "
                              "leading dashes): redeploy to store it so", permanent=True)
        flag = f"--{name}"
        if flag in RESERVED_FLAGS and name in engine_args:
            raise EngineError(reserved(flag), permanent=True)
        # False/None leave the engine's default; vLLM spells "off" for on-by-default flags --no-X.
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(_word(name, v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, _word(name, value)]
    return argv


@functools.lru_cache(maxsize=8)
def _flags_cached(vllm_bin: str, mtime: float, timeout_s: float) -> frozenset[str]:
    env = processenv.engine_environ({})
    try:
        out = subprocess.run(
            [vllm_bin, "serve", "--help=all"],
            capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        raise EngineError(f"`{vllm_bin} serve --help=all` took over {timeout_s:.0f} s") from e
    except OSError as e:
        raise EngineError(f"cannot run {vllm_bin}: {e}", permanent=True) from e
    flags = set()
    for line in out.stdout.splitlines():
        # Option lines are indented 2 spaces: "  --tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp ..."
        # or "  --enable-prefix-caching, --no-enable-prefix-caching"; descriptions sit deeper.
        if re.match(r"^ {2,4}-", line):
            flags.update(re.findall(r"(?:^|,\s*)(--[a-z0-9][a-z0-9-]*)", line.strip()))
    if out.returncode != 0 or "--port" not in flags:
        raise EngineError(f"`{vllm_bin} serve --help=all` failed: {out.stderr[-500:]}", permanent=True)
    return frozenset(flags)


# What `vllm --version` prints, without what it costs: the CLI imports much of vLLM first (~15 s of CPU).
_METADATA_VERSION = "import importlib.metadata as m; print(m.version('vllm'))"


def _interpreter(vllm_bin: str) -> str | None:
    """The Python a pip-installed `vllm` script runs under, when its `#!` line names one directly."""
    try:
        with open(vllm_bin, "rb") as f:
            first = f.readline(512).decode(errors="replace").strip()
    except OSError:
        return None
    found = re.match(r"^#!(/\S*/python[0-9.]*)$", first)
    return found.group(1) if found and os.access(found.group(1), os.X_OK) else None


@functools.lru_cache(maxsize=8)
def _version_cached(vllm_bin: str, mtime: float, timeout_s: float) -> str:
    env = processenv.engine_environ({})
    python = _interpreter(vllm_bin)
    for argv in ([[python, "-c", _METADATA_VERSION]] if python else []) + [[vllm_bin, "--version"]]:
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env,
                                 stdin=subprocess.DEVNULL)
        except (subprocess.TimeoutExpired, OSError):
            continue
        versions = [line.strip() for line in out.stdout.splitlines() if re.match(r"^\d+\.\d+\S*$", line.strip())]
        if out.returncode == 0 and versions:
            return versions[-1][:64]
    return ""


# How to get an engine where there is none: in the launch failure, the host doctor's engine check and ./panel start.
ENGINE_FIX = ("install an engine on this node: scripts/install-engine (the CPU build of vLLM, for a machine without an "
              "NVIDIA GPU) or vLLM in a venv of its own, then point the agent at it with VLLM_BIN and restart the agent")


def engine_version(vllm_bin: str, timeout_s: float = 120.0) -> str:
    """What `vllm --version` says ("0.32.0+cpu"), asked of its interpreter's package metadata when the script
    names one, or "" when it cannot tell (cached per binary)."""
    try:
        mtime = os.stat(vllm_bin).st_mtime
    except OSError:
        return ""
    return _version_cached(str(vllm_bin), mtime, timeout_s)


def _flags_file(vllm_bin: str, mtime: float, version: str) -> Path:
    """Where the flags of this binary at this version are kept between agent starts. `vllm serve --help=all`
    imports vLLM (~20 s of CPU here, more on a busy host): every agent start and restart paid it."""
    root = Path(os.environ.get("PANEL_CACHE_DIR") or Path.home() / ".cache" / "vllm-controlpanel")
    key = hashlib.sha256(f"{os.path.realpath(vllm_bin)}\0{mtime}\0{version}".encode()).hexdigest()[:32]
    return root / "engine-flags" / f"{key}.json"


@functools.lru_cache(maxsize=8)
def _flags_kept(vllm_bin: str, mtime: float, version: str, timeout_s: float) -> frozenset[str]:
    """The flags from the file an earlier agent kept, else from the engine (then kept); read once a process."""
    kept = _flags_file(vllm_bin, mtime, version) if version else None
    if kept is not None:
        try:
            flags = json.loads(kept.read_text())
            if isinstance(flags, list) and "--port" in flags:
                return frozenset(flags)
        except (OSError, ValueError):
            pass
    flags = _flags_cached(vllm_bin, mtime, timeout_s)
    if kept is not None:
        try:  # written whole, then renamed: a concurrent agent reads the old file or the new one
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp = kept.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(sorted(flags)))
            os.replace(tmp, kept)
        except OSError:
            pass  # a read-only home: ask the engine again next start
    return flags


def engine_flags(vllm_bin: str, timeout_s: float = 120.0) -> set[str]:
    """The `--flags` this engine's `vllm serve` accepts, from its own --help=all (cached per binary, and on
    disk per binary, modification time and version when the version is known)."""
    try:
        mtime = os.stat(vllm_bin).st_mtime
    except OSError as e:
        raise EngineError(f"no engine at {vllm_bin}: {e}", permanent=True) from e
    return set(_flags_kept(str(vllm_bin), mtime, engine_version(vllm_bin, timeout_s), timeout_s))


def validate_args(engine_args: dict, flags: set[str]) -> dict[str, str]:
    """Map each bad key of canonical `engine_args` to a message; unknown flags get a close-match suggestion."""
    errors = {}
    for name in engine_args:
        if not flagpolicy.is_canonical(name):
            errors[name] = f"{str(name)[:40]!r} is not a flag name in canonical form"
            continue
        flag = f"--{name}"
        if flag in RESERVED_FLAGS:
            errors[name] = reserved(flag)
        elif flag not in flags:
            close = difflib.get_close_matches(flag, sorted(flags), n=1, cutoff=0.75)
            hint = f"; did you mean {close[0]}?" if close else ""
            errors[name] = f"unknown engine flag {flag}{hint}"
    return errors
