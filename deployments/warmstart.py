"""Warm starts: the compile cache a start uses and the memory profile it may reuse, and what a load records of both.

Beneath both sides (imports models, selectors and host code only): the control plane checks a reused profile before
a deploy is queued (services/deploys.py), the node checks it again and prepares the compile cache at launch
(node/plan.py), and the load watch (loads.py) records what the start was. The folders and the log lines are
host/compilecache.py's.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from deployments import selectors
from deployments.contextfit import EngineKv
from deployments.host import compilecache, osuser
from deployments.models import Deployment, ModelRepo, Node

log = logging.getLogger(__name__)
__all__ = ["ProfileRefused", "cache_summary", "launch_prepare", "load_data", "profile_of", "relaunch_extras",
           "reusable_profile"]
# Besides the graph settings, what decides how much memory the KV cache gets: a profile is reused only when these
# are the same too. The KV size itself is what the reuse passes, so it is never part of the match.
MEMORY_ARGS = ("gpu-memory-utilization", "swap-space", "cpu-offload-gb", "max-num-seqs", "max-model-len")
MEMORY_ENV = ("VLLM_CPU_KVCACHE_SPACE",)
RECENT = 20  # loads of a model on a node searched for a matching profile


class ProfileRefused(Exception):
    """The last memory profile cannot be reused for these settings; the message says what changed."""


def profile_settings_key(engine_args: dict, env: dict | None = None) -> str:
    """What a profile must match besides the GPUs and the engine: the graph settings and the memory settings."""
    args = {k: v for k, v in engine_args.items() if k != "kv-cache-memory-bytes"}
    parts = {"graph": compilecache.graph_settings(args, env), "memory": {k: args.get(k) for k in MEMORY_ARGS},
             "memory_env": {k: (env or {}).get(k) for k in MEMORY_ENV}}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _gpu_uuids(node: Node, gpu_indices) -> list[str]:
    by_index = {g.index: g.uuid or f"index {g.index}" for g in node.gpus.all()}
    return [by_index.get(i, f"index {i}") for i in sorted(gpu_indices)]


def _expected(node: Node, gpu_indices, engine_args: dict, env: dict | None) -> dict:
    return {"gpus": _gpu_uuids(node, gpu_indices), "settings": profile_settings_key(engine_args, env),
            "engine": node.engine_version or ""}


def profile_of(d: Deployment, engine_kv: EngineKv, reused: int | None = None) -> dict | None:
    """What a finished load records for the next start: the KV cache bytes per worker the engine chose (or the
    ones it was given), its tokens, the GPUs, the settings key and the engine version. None without a size."""
    kv_bytes = reused or engine_kv.kv_bytes
    if not kv_bytes or (engine_kv.explicit and not reused):
        return None
    return {"kv_bytes": int(kv_bytes), "kv_tokens": engine_kv.tokens,
            **_expected(d.node, d.gpu_indices, d.engine_args, d.env)}


def reusable_profile(model: ModelRepo, node: Node, gpu_indices, engine_args: dict, env: dict | None) -> int:
    """The KV cache bytes of the newest load of `model` on `node` whose GPUs, settings and engine are these, or
    ProfileRefused saying what changed since the newest load that recorded a profile."""
    want = _expected(node, gpu_indices, engine_args, env)
    if not want["engine"]:
        raise ProfileRefused(f"{node} has not reported its engine version yet: a memory profile cannot be matched.")
    loads = list(selectors.load_events(data__model=model.pk, deployment__node=node)
                 .filter(data__profile__has_key="kv_bytes")[:RECENT])
    for event in loads:
        have = event.data["profile"]
        if all(have.get(k) == want[k] for k in ("gpus", "settings", "engine")):
            return int(have["kv_bytes"])
    if not loads:
        raise ProfileRefused(f"No earlier load of {model} on {node} recorded a memory profile: deploy once without "
                             "\"reuse the last memory profile\".")
    have = loads[0].data["profile"]
    changed = []
    if have.get("gpus") != want["gpus"]:
        changed.append(f"the GPUs changed ({', '.join(have.get('gpus') or ['none'])} then, "
                       f"{', '.join(want['gpus']) or 'none'} now)")
    if have.get("settings") != want["settings"]:
        changed.append("the settings that shape the graph or the memory changed")
    if have.get("engine") != want["engine"]:
        changed.append(f"the engine version changed ({have.get('engine') or '?'} then, {want['engine']} now)")
    raise ProfileRefused(f"The last memory profile of {model} on {node} cannot be reused: " + "; ".join(changed)
                         + ". Deploy without \"reuse the last memory profile\" once to record a new one.")


def launch_prepare(d: Deployment, model_path: str, user: osuser.EngineUser) -> tuple[dict, dict, dict]:
    """On the node, just before the launch: (extra engine flags, extra variables, what the start is). The compile
    cache folder is made for the engine user (VLLM_CACHE_ROOT); a deployment that sets VLLM_CACHE_ROOT itself keeps
    it, unmanaged. With reuse_memory_profile the KV size of the last matching load is passed, or ProfileRefused."""
    args, env, start = {}, {}, {}
    if d.reuse_memory_profile:
        kv_bytes = reusable_profile(d.model, d.node, d.gpu_indices, d.engine_args, d.env)
        args["kv-cache-memory-bytes"] = kv_bytes
        start["profile_reused"] = kv_bytes
    if "VLLM_CACHE_ROOT" in (d.env or {}):
        start["compile_cache"] = {"managed": False, "path": d.env["VLLM_CACHE_ROOT"]}
        return args, env, start
    store = d.node.model_store
    if not store:
        return args, env, start
    key = compilecache.cache_key(d.model.commit or d.model.revision, d.node.engine_version, d.engine_args, d.env)
    try:
        prepared = compilecache.prepare(store, model_path, key, user)
    except compilecache.CompileCacheError as exc:  # a cold start, never a failed one
        log.warning("deployment %s: %s", d.pk, exc)
        start["compile_cache"] = {"managed": False, "error": exc.message}
        return args, env, start
    env["VLLM_CACHE_ROOT"] = prepared.path
    start["compile_cache"] = {"managed": True, "key": key, "path": prepared.path, "folder_warm": prepared.warm,
                              "bytes_before": prepared.bytes, "model_folder": compilecache.model_folder_name(model_path, store)}
    return args, env, start


def relaunch_extras(d: Deployment) -> tuple[dict, dict]:
    """The flags and variables of the start recorded at the last launch (the engine restarted under systemd)."""
    start = (d.load_detail or {}).get("start") or {}
    cache = start.get("compile_cache") or {}
    return ({"kv-cache-memory-bytes": start["profile_reused"]} if start.get("profile_reused") else {},
            {"VLLM_CACHE_ROOT": cache["path"]} if cache.get("managed") else {})


def load_data(d: Deployment, start: dict, hits: compilecache.HitWatch, engine_kv: EngineKv) -> dict:
    """What a finished load's event records of its start: `start` "cold" or "warm", `warm_by` (which of compile
    cache and reused profile made it warm), the compile cache's verdict and sizes, and the profile for the next start."""
    cache = dict(start.get("compile_cache") or {})
    if cache:
        cache["verdict"] = hits.verdict()
        cache["lines"] = hits.lines
    if cache.get("managed"):
        try:
            cache["bytes"] = compilecache.size_bytes(cache["path"])
            cache["model_bytes"] = compilecache.size_bytes(Path(cache["path"]).parent)  # every key of the model
        except OSError:
            pass
    # The log is the witness: a folder that held artifacts but was compiled from scratch (vLLM's own hash differed)
    # is cold; one whose artifact failed to load was compiled again over its cached kernels (perf/warm_start.py).
    hit = cache.get("verdict") in ("hit", "partial") or (cache.get("verdict") == "recompiled" and cache.get("folder_warm"))
    warm_by = [*(["compile cache"] if hit else []), *(["memory profile"] if start.get("profile_reused") else [])]
    reused = start.get("profile_reused")
    return {"start": "warm" if warm_by else "cold", "warm_by": warm_by, "compile_cache": cache,
            "profile_reused": reused, "profile": profile_of(d, engine_kv, reused)}


def cache_summary(node: Node, model: ModelRepo) -> dict | None:
    """The compile caches of a model on a node as its newest load saw them: their size and whether it hit."""
    event = selectors.load_events(data__model=model.pk, deployment__node=node).filter(
        data__compile_cache__has_key="verdict").first()
    cache = event and event.data.get("compile_cache")
    if not cache:
        return None
    return {"bytes": cache.get("model_bytes", cache.get("bytes")), "verdict": cache.get("verdict"),
            "start": event.data.get("start"), "at": event.started}
