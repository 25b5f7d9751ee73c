"""The compile cache kept per model in the store: its key, its folder's owner and mode, what the engine's log
says it did, and its removal. No vLLM, no database (the real engine's hit and miss: perf/warm_start.py)."""
import os
import stat
from pathlib import Path

import pytest

from deployments.host import compilecache, osuser

ARGS = {"max-model-len": 1024, "tensor-parallel-size": 2, "served-model-name": "tiny", "port": 8000}
# vLLM 0.32's own lines (vllm/compilation/backends.py, decorators.py), as the CPU and GPU engines print them.
PREFIX = "(Worker pid=17658) INFO 12-03 17:54:34 "
COMPILED = [PREFIX + "[backends.py:383] [backbone] Cache the graph of compile range (1, 8192) for later use",
            PREFIX + "[backends.py:399] [backbone] Compiling a graph for compile range (1, 8192) takes 21.37 s"]
LOADED = [PREFIX + "[backends.py:296] [backbone] Directly load the compiled graph(s) for compile range (1, 8192) "
                   "from the cache, took 0.812 s"]
AOT_LOADED = [PREFIX + "[decorators.py:320] [backbone] Directly load AOT compilation from path /s/.compile-cache/m/k/x"]
AOT_SAVED = [PREFIX + "[decorators.py:743] [backbone] saved AOT compiled function to /s/.compile-cache/m/k/rank_0_0/model"]
AOT_RELOAD_FAILED = [PREFIX + "WARNING [decorators.py:333] [backbone] Compiling model again due to a load failure from "
                              "/s/.compile-cache/m/k/rank_0_0/model, reason: 'function' object has no attribute "
                              "'finalize_loading'", *AOT_SAVED]


def _key(args=ARGS, env=None, commit="abc", version="0.32.0"):
    return compilecache.cache_key(commit, version, args, env)


def test_flags_that_change_the_graph_change_the_key():
    for changed in ({"max-model-len": 2048}, {"tensor-parallel-size": 4}, {"enforce-eager": True},
                    {"kv-cache-dtype": "fp8"}, {"max-num-seqs": 8}, {"compilation-config": '{"mode": 3}'}):
        assert _key({**ARGS, **changed}) != _key(), changed


def test_flags_that_do_not_change_the_graph_keep_the_key():
    for same in ({"port": 9000}, {"host": "0.0.0.0"}, {"served-model-name": "other"}, {"api-key": "sk-1"},
                 {"gpu-memory-utilization": 0.5}, {"kv-cache-memory-bytes": 10**9}, {"disable-log-stats": True},
                 {"disable-uvicorn-access-log": True}, {"uvicorn-log-level": "debug"}):
        assert _key({**ARGS, **same}) == _key(), same
    assert _key(env={"VLLM_LOGGING_LEVEL": "DEBUG"}) == _key(env={})


def test_the_model_commit_the_engine_version_and_graph_variables_change_the_key():
    assert _key(commit="def") != _key()
    assert _key(version="0.33.0") != _key()
    assert _key(env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"}) != _key(env={})


def test_a_store_model_and_a_local_model_get_folders_of_their_own(tmp_path):
    store = tmp_path / "store"
    inside = compilecache.model_caches(store, store / "org--m@v1")
    assert inside == store / ".compile-cache" / "org--m@v1"
    a = compilecache.model_folder_name(tmp_path / "a" / "m", store)
    b = compilecache.model_folder_name(tmp_path / "b" / "m", store)
    assert a != b and a.startswith("m~") and b.startswith("m~")


def test_the_folder_is_the_engine_users_own_and_closed_to_everyone_else(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    user = osuser.resolve(osuser.DEFAULT_NAME)
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    prepared = compilecache.prepare(store, store / "org--m", _key(), user)
    assert osuser.can_reach(user, prepared.path, "r")  # the store is entered, as for a local model's start
    path = Path(prepared.path)
    assert path == store / ".compile-cache" / "org--m" / _key()
    st = path.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (user.uid, user.gid, 0o700)
    for above in (path.parent, path.parent.parent):  # enter-only for the engines' group: nothing can be listed
        st = above.stat()
        assert (st.st_gid, stat.S_IMODE(st.st_mode)) == (user.gid, 0o710)
    assert not prepared.warm and prepared.bytes == 0
    (path / "torch_compile_cache").mkdir()
    (path / "torch_compile_cache" / "model").write_bytes(b"x" * 100)
    again = compilecache.prepare(store, store / "org--m", _key(), user)
    assert again.warm and again.bytes == 100
    assert (path / "torch_compile_cache" / "model").stat().st_uid == 0  # the engine's folder is never walked as root


def test_without_a_separate_engine_user_the_folder_is_0700(tmp_path):
    own = osuser.EngineUser(name="me", uid=os.getuid(), gid=os.getgid(), separate=False)
    prepared = compilecache.prepare(tmp_path, tmp_path / "m", "k", own)
    assert stat.S_IMODE(Path(prepared.path).stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / ".compile-cache").stat().st_mode) == 0o700
    assert not compilecache.has_artifacts(prepared.path)  # empty folders are not a cache


def _verdict(lines):
    watch = compilecache.HitWatch()
    for line in lines:
        watch.feed(line)
    return watch.verdict()


def test_the_log_tells_a_hit_from_a_miss():
    assert _verdict(COMPILED) == "miss"
    assert _verdict(AOT_SAVED) == "miss"
    assert _verdict(LOADED) == "hit"
    assert _verdict(AOT_LOADED) == "hit"
    assert _verdict(LOADED + COMPILED) == "partial"
    assert _verdict(AOT_RELOAD_FAILED) == "recompiled"
    assert _verdict([PREFIX + "[backends.py:1102] vLLM's torch.compile cache is disabled."]) == "disabled"
    assert _verdict([PREFIX + "[core.py:402] init engine (profile, create kv cache, warmup model) took 3.1 s"]) == "none"


def test_a_models_caches_are_removed_and_others_kept(tmp_path):
    own = osuser.EngineUser(name="me", uid=os.getuid(), gid=os.getgid(), separate=False)
    for model, key in (("org--a", "k1"), ("org--a", "k2"), ("org--b", "k1")):
        path = Path(compilecache.prepare(tmp_path, tmp_path / model, key, own).path)
        (path / "artifact").write_bytes(b"x" * 10)
    assert compilecache.sizes(tmp_path) == {"org--a": 20, "org--b": 10}
    assert compilecache.remove_model(tmp_path, tmp_path / "org--a") == 20
    assert compilecache.sizes(tmp_path) == {"org--b": 10}
    assert compilecache.remove_model(tmp_path, tmp_path / "org--a") == 0
