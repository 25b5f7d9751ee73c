"""vLLM's compile cache kept per model in the node's model store, so a second start skips torch.compile.

One folder per (model folder, model commit, engine version, settings that change the compiled graph):
`<model_store>/.compile-cache/<model folder name>/<key>`, handed to the engine as VLLM_CACHE_ROOT. vLLM hashes
its own factors inside that root too (torch_compile_cache/<hash>/), so a key that is too coarse costs a miss,
never a wrong graph; a key that is too fine only costs disk. Whether a start hit it is told twice: the folder
held compiled artifacts before the launch, and the engine's log says it loaded them (HitWatch).

Plain Python, no Django.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from deployments.host import osuser
from deployments.host.errors import HostError

ROOT_NAME = ".compile-cache"
# Engine flags that never change the compiled graph: where the server listens and what it calls itself, its
# keys, logging, and how much memory the KV cache gets (the graph is compiled for shapes, not for a pool size).
# Every other flag is part of the key: an unknown flag costs a cold start at worst.
NON_GRAPH_ARGS = frozenset({
    "host", "port", "uds", "served-model-name", "api-key", "root-path", "allowed-origins", "allowed-methods",
    "allowed-headers", "allow-credentials", "ssl-keyfile", "ssl-certfile", "ssl-ca-certs", "ssl-cert-reqs",
    "middleware", "disable-uvicorn-access-log", "uvicorn-log-level", "disable-log-requests", "enable-log-requests",
    "disable-log-stats", "enable-log-outputs", "max-log-len", "disable-fastapi-docs", "enable-prompt-tokens-details",
    "enable-server-load-tracking", "enable-force-include-usage", "response-role", "chat-template",
    "chat-template-content-format", "return-tokens-as-token-ids", "enable-auto-tool-choice", "tool-call-parser",
    "tool-parser-plugin", "reasoning-parser", "gpu-memory-utilization", "kv-cache-memory-bytes", "swap-space",
    "disable-frontend-multiprocessing", "api-server-count", "load-format",
    "safetensors-load-strategy", "download-dir", "model-loader-extra-config", "trust-remote-code",
    "enable-sleep-mode", "headless", "data-parallel-address", "data-parallel-rpc-port", "master-addr", "master-port",
    "nnodes", "node-rank", "distributed-executor-backend",
})
# Deployment variables that never change the compiled graph (logging, the CPU engine's KV space, tokens).
NON_GRAPH_ENV = frozenset({"VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_CPU_KVCACHE_SPACE", "HF_TOKEN",
                           "VLLM_API_KEY", "VLLM_SERVER_DEV_MODE", "VLLM_NO_USAGE_STATS", "DO_NOT_TRACK",
                           "PYTHONUNBUFFERED", "NCCL_DEBUG", "VLLM_CACHE_ROOT"})

# vLLM 0.32's log lines (vllm/compilation/backends.py, decorators.py, caching.py) on a load from the cache and on
# a compile that stores into it.
HIT_LINE = re.compile(r"Directly load the compiled graph\(s\) for compile range .* from the cache"
                      r"|Directly load AOT compilation from path|reconstructed serializable fn from standalone compile")
MISS_LINE = re.compile(r"Compiling a graph for compile range|Cache the graph of compile range|saved AOT compiled function to")
# vLLM found its AOT artifact but could not load it and compiled again. The Inductor kernels in the same folder
# (vLLM points TORCHINDUCTOR_CACHE_DIR there) still answer, so the compile is shorter but not skipped. vLLM 0.32's
# CPU build always ends here on a second start ('function' object has no attribute 'finalize_loading').
RELOAD_FAILED_LINE = re.compile(r"Compiling model again due to a load failure")
DISABLED_LINE = re.compile(r"vLLM's torch\.compile cache is disabled")


class CompileCacheError(HostError):
    """The cache folder cannot be made or removed."""


def graph_settings(engine_args: dict, env: dict | None = None) -> dict:
    """The flags and deployment variables that change the compiled graph (canonical flag names, no dashes)."""
    return {"args": {k: v for k, v in sorted(engine_args.items()) if k.lstrip("-") not in NON_GRAPH_ARGS},
            "env": {k: v for k, v in sorted((env or {}).items()) if k not in NON_GRAPH_ENV}}


def settings_key(engine_args: dict, env: dict | None = None) -> str:
    """A short hash of graph_settings: what a remembered memory profile must match too."""
    return _hash(graph_settings(engine_args, env))


def cache_key(commit: str, engine_version: str, engine_args: dict, env: dict | None = None) -> str:
    """The folder name of one compile cache: the model's commit, the engine's version and the graph settings."""
    return _hash({"commit": commit or "", "engine": engine_version or "", **graph_settings(engine_args, env)})


def _hash(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_folder_name(model_path: str | Path, store: str | Path) -> str:
    """The model's folder name in the store; a folder elsewhere (a user's own) gets a hash of its path, so
    two local models named alike never share caches."""
    path, root = Path(model_path).resolve(), Path(store).resolve()
    if root in path.parents:
        return path.relative_to(root).parts[0]
    return f"{path.name or 'model'}~{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"


def model_caches(store: str | Path, model_path: str | Path) -> Path:
    """The folder that holds every compile cache of one model."""
    return Path(store) / ROOT_NAME / model_folder_name(model_path, store)


def has_artifacts(path: str | Path) -> bool:
    """The folder holds a compiled artifact (any file vLLM or Inductor wrote), not just empty folders."""
    path = Path(path)
    if not path.is_dir():
        return False
    for _, _, files in os.walk(path):
        if files:
            return True
    return False


def size_bytes(path: str | Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


@dataclass
class Prepared:
    """One start's cache folder, and whether it held compiled artifacts before the launch."""

    path: str
    warm: bool
    bytes: int


def prepare(store: str | Path, model_path: str | Path, key: str, user: osuser.EngineUser) -> Prepared:
    """Make `<store>/.compile-cache/<model>/<key>` for `user`'s engine: the key folder owned by it, 0700, so no
    other local user reads it; the folders above enter-only for its group (0710, no listing), so the key folders
    of other models cannot be found by listing. Engines of every deployment run as the same engine user, so one of
    them that computes another's path could still read that cache: the isolation between deployments is only the
    unlisted path, not the kernel's."""
    root = Path(store) / ROOT_NAME
    model_dir = model_caches(store, model_path)
    path = model_dir / key
    try:
        if user.separate:  # a model outside the store (a local one) did not open the store to the engine's group
            st = Path(store).stat()
            if not st.st_mode & 0o001 and not (st.st_gid == user.gid and st.st_mode & 0o010):
                os.chown(store, -1, user.gid)
                os.chmod(store, stat.S_IMODE(st.st_mode) | 0o010)
        for folder in (root, model_dir):
            folder.mkdir(mode=0o700, exist_ok=True)
            if user.separate:
                os.chown(folder, -1, user.gid)
                os.chmod(folder, 0o710)
            else:
                os.chmod(folder, 0o700)
        if user.separate:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                st = None
            if st is not None and (not stat.S_ISDIR(st.st_mode) or st.st_uid != user.uid):
                # Made by an earlier agent as root: made again, never walked (what the engine wrote in a
                # folder of its own is not root's to touch; the cost is one cold compile).
                shutil.rmtree(path) if stat.S_ISDIR(st.st_mode) else os.unlink(path)
            osuser.own_folder(path, user, 0o700)
        else:
            path.mkdir(mode=0o700, exist_ok=True)
            os.chmod(path, 0o700)
    except OSError as exc:
        raise CompileCacheError(f"cannot prepare the compile cache {path}: {exc}", permanent=True) from exc
    return Prepared(path=str(path), warm=has_artifacts(path), bytes=size_bytes(path))


def remove_model(store: str | Path, model_path: str | Path) -> int:
    """Delete every compile cache of a model (its copy is deleted); returns the bytes freed."""
    target = model_caches(store, model_path)
    if not target.is_dir() or target.is_symlink():
        return 0
    freed = size_bytes(target)
    try:
        shutil.rmtree(target)
    except OSError as exc:
        raise CompileCacheError(f"cannot remove the compile caches in {target}: {exc}") from exc
    return freed


def sizes(store: str | Path) -> dict[str, int]:
    """Bytes of compile caches per model folder name in the store (for the node's report)."""
    root = Path(store) / ROOT_NAME
    if not root.is_dir():
        return {}
    return {entry.name: size_bytes(entry) for entry in sorted(root.iterdir()) if entry.is_dir() and not entry.is_symlink()}


@dataclass
class HitWatch:
    """Reads the engine's log for what its compile cache did: counts of load and compile lines."""

    loaded: int = 0
    compiled: int = 0
    reload_failed: int = 0
    disabled: bool = False
    lines: list[str] = field(default_factory=list)  # the first few telling lines, for the timeline

    def feed(self, line: str) -> None:
        for text in line.split("\r"):
            if HIT_LINE.search(text):
                self.loaded += 1
            elif RELOAD_FAILED_LINE.search(text):
                self.reload_failed += 1
            elif MISS_LINE.search(text):
                self.compiled += 1
            elif DISABLED_LINE.search(text):
                self.disabled = True
            else:
                continue
            if len(self.lines) < 3:
                self.lines.append(text.strip()[-200:])

    def verdict(self) -> str:
        """"hit" (every graph loaded), "partial" (some loaded, some compiled), "recompiled" (the artifact was there
        but failed to load: compiled again over the cached kernels), "miss" (compiled), "disabled", or "none" (no
        compile: --enforce-eager, or a log that said nothing yet)."""
        if self.disabled:
            return "disabled"
        if self.reload_failed:
            return "recompiled"
        if self.loaded and self.compiled:
            return "partial"
        return "hit" if self.loaded else "miss" if self.compiled else "none"
