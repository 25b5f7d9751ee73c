"""The model store on a node: where a model's files live, local folders, safe deletion."""
from __future__ import annotations

import hashlib
import inspect
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from deployments.host import folderlist, osuser
from deployments.host.errors import HostError

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class StoreError(HostError):
    """A model-store operation refused or failed."""

    PERMANENT = True


@dataclass(frozen=True)
class LocalModel:
    """A model folder already on the node: its files (relative path, size) and parsed config.json."""

    path: str
    files: list[tuple[str, int]]
    config: dict | None
    total_size: int


def model_dir(store: str | Path, repo_id: str, revision: str) -> Path:
    """`<store>/<org>--<name>[@<revision>]`: one folder per repo and revision, never outside the store.

    Where making a name safe loses information (revisions `a/b` and `a_b`, a repo with `--`), a
    hash of the exact (repo, revision) is appended after a `~`, which a made-safe name never
    contains, so two of them never share a folder."""
    name = _SAFE.sub("_", repo_id.replace("/", "--"))
    lossy = name.replace("--", "/", 1) != repo_id or repo_id.count("/") > 1
    if revision and revision != "main":
        safe = _SAFE.sub("_", revision)
        lossy = lossy or safe != revision
        name += "@" + safe
    if lossy:
        name += "~" + hashlib.sha256(f"{repo_id}\0{revision}".encode()).hexdigest()[:10]
    return Path(store) / name


MAX_FILES = 20_000  # the largest Hub models have a few hundred files


def inspect_local(path: str | Path, roots: list[str], run_as=None) -> LocalModel:
    """List a local model folder and read its config.json: only below one of `roots` (the folders an admin declared
    for local models, the model store among them), and read as `run_as` (the engine user, an osuser.EngineUser; None
    or not separate: this process) in a child of its own, so root never reads a folder on an operator's word."""
    root = Path(path)
    if not root.is_absolute():
        raise StoreError(f"{path} is not an absolute path")
    real = os.path.realpath(root)
    allowed = [os.path.realpath(r) for r in roots if r]
    if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in allowed):
        raise StoreError(f"{path} is outside the folders this node reads models from ({', '.join(allowed) or 'none'}): "
                         "an admin adds one with LOCAL_MODEL_ROOTS on the node's agent")
    if run_as is not None and run_as.separate:
        try:
            found = osuser.python_as(inspect.getsource(folderlist), [real, str(MAX_FILES)], run_as.uid, run_as.gid,
                                     run_as.groups, timeout=300)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            raise StoreError(f"cannot read {path} as {run_as.name}: {exc}") from exc
        if "error" in found:
            raise StoreError(f"{found['error']} (read as {run_as.name}, who runs the engines)")
    else:
        try:
            found = folderlist.listing(real, MAX_FILES)
        except ValueError as exc:
            raise StoreError(str(exc)) from exc
    files = [(str(p), int(size)) for p, size in found["files"]]
    return LocalModel(path=real, files=files, config=found["config"], total_size=sum(size for _, size in files))


def remove(path: str | Path, store: str | Path) -> int:
    """Delete a model folder inside the store; returns the bytes freed. Refuses anything outside it."""
    target, root = Path(path).resolve(), Path(store).resolve()
    if target == root or root not in target.parents:
        raise StoreError(f"refusing to delete {target}: it is not inside the model store {root}")
    if not target.exists():
        return 0
    freed = sum(p.stat().st_size for p in target.rglob("*") if p.is_file() and not p.is_symlink())
    shutil.rmtree(target)
    return freed
