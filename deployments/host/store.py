"""The model store on a node: where a model's files live, local folders, safe deletion."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

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


def inspect_local(path: str | Path) -> LocalModel:
    """List a local model folder and read its config.json."""
    root = Path(path)
    if not root.is_absolute():
        raise StoreError(f"{path} is not an absolute path")
    if not root.is_dir():
        raise StoreError(f"{path} is not a folder on this node")
    # A model folder has a config.json at its top: checked before walking, so "/" or a home folder
    # is refused at once instead of being walked file by file.
    if not (root / "config.json").is_file():
        raise StoreError(f"{path} has no config.json: not a model folder")
    files = []
    for p in root.rglob("*"):
        if p.is_file() and ".partial" not in p.parts:
            files.append((str(p.relative_to(root)), p.stat().st_size))
            if len(files) > MAX_FILES:
                raise StoreError(f"{path} holds more than {MAX_FILES} files: not a model folder")
    files.sort()
    config = None
    if (root / "config.json").is_file():
        try:
            config = json.loads((root / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise StoreError(f"{root / 'config.json'} is not valid JSON: {exc}") from exc
    return LocalModel(path=str(root), files=files, config=config, total_size=sum(size for _, size in files))


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
