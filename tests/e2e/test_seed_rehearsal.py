"""The seed day rehearsed, driven through the REST API with an operator's token as a script would, on one
host of 8 simulated GPUs (96 GB, compute capability 12.0, a display server on GPU 0), the whole panel (web server,
control worker, node agent, gateway) and the conformant doubles (tests/rehearsal.py): free the disk, download 64
shards through every fault the Hub gives, replace the MiniMax-like deployment with the Kimi-like one from its recipe
(TP 8, TRITON_MLA, NCCL variables, the SM120 overlay) through the recorded 36-minute load, smoke test, benchmark to
c=1,024 with reasoning answers, an NCCL Ring vs LL study, persist, reboot, and the engine adopted and routed by the
gateway. Each step prints its wall time and the panel's own words; the assertions are the states and what was seen,
never how long anything took. perf/seed_rehearsal.py runs it at full size.

Slow (~3-4 minutes here): the day's steps are what is tested, and one of them is a 60+ s stall of a download, which
the download's own read timeout (60 s) must outlast."""

import json
import logging
import sys
from pathlib import Path

import httpx
import pytest

from deployments.host import processlog
from deployments.models import Deployment
from tests.conftest import free_port, wait_until
from tests.hfserver import configure, get_stats, serve
from tests.rehearsal import GPUS, KIMI, OLD, Clock, Host, Size, engine, grow_sparse, hub_repos, local_models
from tests.truestate import stop_leftover_engines

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(Size.chosen().timeout_s)]
ALL = list(range(GPUS))
STUDY_SPEED = 400.0
logging.getLogger("httpx").setLevel(logging.WARNING)  # each request's line would drown the day's


class Api:
    """The panel's REST API with an operator's token, as a script calls it."""

    def __init__(self, url: str, token: str):
        self.http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Token {token}"})

    def get(self, path: str):
        answer = self.http.get(path)
        assert answer.status_code == 200, f"GET {path}: {answer.status_code} {answer.text[:1000]}"
        return answer.json()

    def post(self, path: str, body: dict | None = None, expect=(200, 201, 202)):
        answer = self.http.post(path, json=body or {})
        assert answer.status_code in expect, f"POST {path}: {answer.status_code} {answer.text[:2000]}"
        return answer.json()

    def until(self, path: str, done, timeout: float, what: str, interval: float = 0.25):
        return wait_until(
            lambda: (row := self.get(path)) and done(row) and row, timeout=timeout, interval=interval, message=what
        )

    def events(self, pk: int) -> list[dict]:
        return self.get(f"/api/deployments/{pk}/events/")["events"]

    def copies(self, node: str, model: int) -> list[dict]:
        return self.get(f"/api/copies/?node={node}&model={model}")["results"]


def _read(api, model) -> dict:
    """The model once read from the Hub (its files and sizes)."""
    row = api.until(
        f"/api/models/{model['id']}/", lambda m: m["total_size"] or m["inspect_error"], 60, "the Hub's read"
    )
    assert not row["inspect_error"], row["inspect_error"]
    return row


def _ready(api, pk, timeout) -> dict:
    d = _settled(api, pk, timeout)
    assert d["status"] == "ready", (d["status_message"], [e["message"][:300] for e in api.events(pk)[-4:]])
    return d


def _ready_copy(api, node, model, timeout=120):
    return wait_until(
        lambda: next((c for c in api.copies(node, model) if c["state"] == "ready"), None),
        timeout=timeout,
        interval=0.25,
        message=f"model {model}'s copy ready on {node}",
    )


def _settled(api, pk, timeout):
    return api.until(
        f"/api/deployments/{pk}/",
        lambda d: d["status"] in ("ready", "failed", "stopped"),
        timeout,
        f"deployment {pk} to settle",
    )


@pytest.fixture
def day(tmp_path, process_env, spawn, unique, live_server_asgi, operator, settings):
    """The panel, the GPU host and its doubles, started; (api, host, size, the hub's URL and folder, models)."""
    from plumbing import tokens
    from tests.factories import UserFactory

    size = Size.chosen()
    hub_root = hub_repos(tmp_path / "hub", size)
    minimax = local_models(tmp_path, size)
    (tmp_path / "Xorg").symlink_to("/bin/sleep")  # the display server NVML lists on GPU 0, by its name
    display = spawn([str(tmp_path / "Xorg"), "3600"], process_env, name="Xorg")
    with serve(hub_root) as hub:
        settings.HF_ENDPOINT = hub  # the web process reads the Hub when a model is added
        # The API's default port is the first free one from ENGINE_PORT_FIRST: from a port free now, so that a second
        # panel on this machine (another suite's rehearsal at the same step) does not choose the same one at the same
        # moment, which the plan then rightly refuses as another process's ("Port 8200 is answered by another process").
        settings.ENGINE_PORT_FIRST = free_port()
        spawn(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "controlpanel",
                "worker",
                "-Q",
                "control",
                "-n",
                f"control-{unique}@%h",
                "--pool",
                "threads",
                "--concurrency",
                "4",
                "--without-gossip",
                "--without-mingle",
            ],
            dict(process_env, HF_ENDPOINT=hub),
            name="control-worker",
        )
        host = Host(spawn, process_env, tmp_path, f"gpu-{unique}", engine(tmp_path), hub, display.pid)
        host.start()
        try:
            yield (
                Api(live_server_asgi, tokens.issue(UserFactory(role="admin"))),
                Api(live_server_asgi, tokens.issue(operator)),
                host,
                size,
                hub,
                hub_root,
                minimax,
            )
        finally:
            host.stop()
            stop_leftover_engines(tmp_path)


def test_the_seed_day_runs_through_the_api_without_a_click(day):
    """Slow (~3-4 minutes on 2 cores): the day's steps in one, among them a 60+ s stall of a download that the
    download's own read timeout (60 s) must outlast, 9 engine loads (the day's, a study of 3 variants x 2 repeats, and
    the one after the reboot) and a benchmark to 1,024 streams."""
    api, operator, host, size, hub, hub_root, minimax_folder = day
    node, clock = host.name, Clock()

    with clock.step("the host as the panel sees it") as s:
        shown = api.until(
            f"/api/nodes/{node}/",
            lambda n: n["online"] and len(n["gpus"]) == GPUS and n["systemd"],
            60,
            "the node online with its GPUs",
        )
        gpus = shown["gpus"]
        assert {g["compute_capability"] for g in gpus} == {"12.0"}, gpus
        s.say(
            f"{node}: {len(gpus)} x {gpus[0]['name']}, {gpus[0]['memory_total'] / 1e9:.0f} GB, "
            f"compute capability {gpus[0]['compute_capability']}; systemd {shown['systemd']}"
        )

    # The callers' key, made once (a key is known to the gateways within a second of its making, docs/gateway.md).
    caller_key = api.post("/api/keys/", {"name": "rehearsal"})["secret"]

    with clock.step("this morning: MiniMax serving on all 8 GPUs") as s:
        minimax = api.post("/api/models/", {"node": node, "local_path": str(minimax_folder)})
        old = api.post("/api/models/", {"repo_id": OLD})  # yesterday's copy, downloaded then
        _read(api, old)
        api.post(f"/api/models/{old['id']}/download/", {"node": node})
        old_folder = Path(_ready_copy(api, node, old["id"])["path"])
        old_bytes = grow_sparse(old_folder, size.old_copy_bytes)
        _ready_copy(api, node, minimax["id"])
        morning = api.post(
            "/api/deployments/",
            {
                "model": minimax["id"],
                "node": node,
                "gpus": ALL,
                "preset": "none",
                "engine_args": {"tensor-parallel-size": 8, "enable-expert-parallel": True},
            },
        )
        _ready(api, morning["id"], 120)
        s.say(api.events(morning["id"])[-1]["message"])

    with clock.step("1. free the disk: delete the old 540 GB-class copy") as s:
        copy = _ready_copy(api, node, old["id"])
        answer = api.http.delete(f"/api/copies/{copy['id']}/")
        assert answer.status_code in (200, 202, 204), answer.text
        wait_until(
            lambda: not any(c["state"] != "deleted" for c in api.copies(node, old["id"])),
            timeout=60,
            message="the copy gone from the list",
        )
        wait_until(lambda: not old_folder.exists(), timeout=60, message="its files deleted")
        s.say(
            f"copy {copy['id']} of {OLD} ({old_bytes / 1e9:.0f} GB on disk, {copy['bytes_total'] / 1e6:.1f} MB as the "
            f"panel downloaded it) deleted: {answer.status_code}"
        )

    with clock.step("2. download 64 shards through every fault the Hub gives") as s:
        kimi = api.post("/api/models/", {"repo_id": KIMI})
        kimi = _read(api, kimi)
        first = f"model-00001-of-{size.shards:05d}.safetensors"
        faults = [
            {"kind": "status", "status": 503},
            {"kind": "reset", "after": size.shard_bytes // 3},
            {"kind": "expired"},
            {"kind": "stall", "after": size.shard_bytes // 6, "seconds": size.stall_s},
            {"kind": "status", "status": 429, "retry_after": 1},
        ]
        configure(hub, faults=[f | {"path": first} for f in faults])
        api.post(f"/api/models/{kimi['id']}/download/", {"node": node})
        seen_retry, rates = [], []

        def watched():
            copy = next(iter(api.copies(node, kimi["id"])), None)
            if copy and (reason := ((copy["progress"] or {}).get("retry") or {}).get("reason")):
                if reason not in seen_retry:
                    seen_retry.append(reason)
                    s.say(f"retry: {reason}")
            if copy and copy["seconds_left"] is not None:
                rates.append(copy["seconds_left"])
            return copy if copy and copy["state"] in ("ready", "failed") else None

        copy = wait_until(watched, timeout=300, interval=0.2, message="the download to end")
        assert copy["state"] == "ready", copy["error"]
        stats = get_stats(hub)
        assert sorted(stats["faults_served"]) == sorted(f["kind"] for f in faults) and not stats["faults_left"], stats
        assert copy["progress"]["retries"] == len(faults), copy["progress"]
        ranges = [r["range"] for r in stats["requests"] if r["path"] == first]
        assert f"bytes={size.shard_bytes // 3}-" in ranges, ranges  # resumed from the kept bytes, not from 0
        assert copy["bytes_done"] == copy["bytes_total"] == size.shards * size.shard_bytes + _small_files(hub_root)
        s.say(
            f"{copy['bytes_done'] / 1e6:.1f} MB in {size.shards} shards, ready; {copy['progress']['retries']} retries; "
            f"faults served {stats['faults_served']}"
        )

    with clock.step("3-4. deploy Kimi (recipe, TP 8, TRITON_MLA, NCCL) replacing MiniMax") as s:
        body = {
            "model": kimi["id"],
            "node": node,
            "gpus": ALL,
            "recipe": KIMI,
            "strategy": "single_node_tp",
            "replace": [morning["id"]],
            "engine_args": {"tensor-parallel-size": 8, "attention-backend": "TRITON_MLA"},
            "env": {"NCCL_P2P_LEVEL": "SYS", "NCCL_IB_DISABLE": "1"},
        }
        # The recipe's --trust-remote-code and --load-format are an admin's to set: an operator is told so.
        refused = operator.post("/api/deployments/", body, expect=(403,))["error"]["message"]
        assert "--trust-remote-code" in refused and "--load-format" in refused, refused
        s.say(f"operator's token: 403 {refused[:120]}")
        kimi_d = api.post("/api/deployments/", body)
        seen = []

        def follow():
            d = api.get(f"/api/deployments/{kimi_d['id']}/")
            left = (d["load_detail"] or {}).get("seconds_left")
            if d["load_phase"] and (not seen or seen[-1][0] != d["load_phase"]):
                s.say(f"phase {d['load_phase']} ({d['load_percent']:.0f} %), time left {left}")
            seen.append((d["load_phase"], left, (d["load_detail"] or {}).get("shards_done")))
            return d if d["status"] in ("ready", "failed", "stopped") else None

        d = wait_until(follow, timeout=2400, interval=0.2, message="the Kimi deployment to settle")
        assert d["status"] == "ready", d["status_message"]
        events = api.events(d["id"])
        for e in events:
            s.say(f"[{e['step']}] {e['message'][:160]}")
        assert api.get(f"/api/deployments/{morning['id']}/")["status"] == "stopped"
        assert d["engine_args"]["attention-backend"] == "TRITON_MLA" and d["engine_args"]["tensor-parallel-size"] == 8
        assert d["engine_args"].get("load-format") == "fastsafetensors", d["engine_args"]  # the SM120 overlay
        assert d["env"]["NCCL_P2P_LEVEL"] == "SYS"
        # The display server on GPU 0 is named, never stopped nor waited for.
        waited = next(e["message"] for e in events if e["step"] == "gpu_memory")
        assert "Xorg" in waited and "display server, not waited for" in waited, waited
        phases = [p for p, _, _ in seen if p]
        order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
        # Several phases, each once and in the order a load goes through them (the agent's own list of them).
        assert len(order) >= 3 and order == sorted(set(order), key=processlog.PHASES.index), order
        etas = [left for _, left, _ in seen if left is not None]
        assert len(etas) >= 2 and etas[-1] < etas[0], etas  # an ETA shown, and going down
        assert not any("stall" in e["message"].lower() for e in events), "a stall was reported on a load that moved"
        s.say(f"phases seen: {' > '.join(order)}; ETA {etas[0]:.0f} s .. {etas[-1]:.0f} s")

    with clock.step("6. smoke test") as s:
        # Run by the plan once the engine answers (after "ready"): its reply, reasoning apart, is on the deployment.
        d = api.until(f"/api/deployments/{d['id']}/", lambda x: x["smoke"], 60, "the smoke test's reply")
        smoke = d["smoke"]
        # An answer, its reasoning apart (long reasoning takes all of the smoke test's tokens: no content then).
        assert smoke["reasoning"] and smoke["reply"] is not None, smoke
        said = next(e for e in reversed(api.events(d["id"])) if e["step"] == "smoke_test")
        s.say(f"[smoke_test] {said['message'][:160]}; reasoning {smoke['reasoning'][:40]!r}")

    with clock.step(f"7. benchmark {size.levels} streams, {size.max_tokens}-token reasoning answers") as s:
        run = api.post(
            "/api/runs/",
            {
                "deployment": d["id"],
                "levels": size.levels,
                "max_tokens": size.max_tokens,
                "input_tokens": 64,
                "ignore_eos": True,
                "requests_per_user": 1,
                "min_requests": 1,
                "warmup_per_user": 0,
                # Every level asked for: past saturation too (by default a sweep stops where more streams stopped
                # buying throughput, which on a loaded 2-core host can be before 1,024).
                "stop_when_saturated": False,
            },
        )
        run = api.until(
            f"/api/runs/{run['id']}/",
            lambda r: r["status"] in ("done", "failed", "cancelled"),
            1200,
            "the benchmark",
            interval=1.0,
        )
        assert run["status"] == "done", run["error"]
        points = {p["concurrency"]: p for p in api.get(f"/api/runs/{run['id']}/points/")}
        assert sorted(points) == sorted(size.levels), (sorted(points), run["warnings"])
        for level, p in sorted(points.items()):
            assert p["timeouts"] == 0 and p["failed_requests"] == 0 and p["num_requests"] >= level, p
            assert p["reasoning_tokens"] > 0 and p["content_tokens"] > 0, p  # reasoning answers, split as they came
            s.say(
                f"c={level}: {p['num_requests']} requests, {p['output_throughput']:.0f} tok/s out, TTFT median "
                f"{(p['ttft_ms'] or {}).get('median', 0):.1f} ms, reasoning/content tokens "
                f"{p['reasoning_tokens']}/{p['content_tokens']}, timeouts {p['timeouts']}"
            )

    if size.corpus_speed < STUDY_SPEED:  # the study's loads repeat the first one: the corpus fast from here on
        fake = Path(copy["path"]) / "fake_engine.json"
        fake.write_text(json.dumps(json.loads(fake.read_text()) | {"replay_speed": STUDY_SPEED}))
    with clock.step("8. NCCL Ring vs LL, with repeats") as s:
        study = api.post(
            "/api/studies/",
            {
                "deployment": d["id"],
                "dimensions": {"NCCL_ALGO": ["Ring", "LL"]},
                "repeats": size.repeats,
                "workload": {
                    "levels": [size.levels[1]],
                    "max_tokens": size.max_tokens,
                    "input_tokens": 64,
                    "ignore_eos": True,
                    "requests_per_user": 2,
                    "min_requests": 8,
                    "warmup_per_user": 0,
                },
            },
        )
        study = api.until(
            f"/api/studies/{study['id']}/",
            lambda x: x["status"] in ("done", "failed", "cancelled"),
            1800,
            "the study",
            interval=1.0,
        )
        assert study["status"] == "done", study["error"]
        results = study["live"]["results"] or {}
        rows = {r["name"]: r for r in results.get("variants", [])}
        assert {"NCCL_ALGO=Ring", "NCCL_ALGO=LL"} <= set(rows), results
        figure = f"throughput@{size.levels[1]}"
        for name in ("NCCL_ALGO=Ring", "NCCL_ALGO=LL"):
            verdict = rows[name]["comparisons"][figure]
            assert verdict["verdict"], verdict
            s.say(
                f"{name} against the baseline, output tok/s at c={size.levels[1]}: {verdict['rel']:+.1%} "
                f"[{_pct(verdict['rel_low'])} .. {_pct(verdict['rel_high'])}], {verdict['verdict']}"
                + (f" ({verdict['why']})" if verdict.get("why") else "")
            )
        s.say(f"winner: {results.get('winner_why') or results.get('winner')}")

    with clock.step("9. persist: a unit enabled at boot, no second load") as s:
        d = _settled(api, d["id"], 300)
        assert d["status"] == "ready", d
        serving = d["pid"]
        api.post(f"/api/deployments/{d['id']}/persist/")
        wait_until(
            lambda: any(e["step"] == "persist" and e["message"].startswith("Installed") for e in api.events(d["id"])),
            timeout=60,
            message="the unit installed",
        )
        d = api.get(f"/api/deployments/{d['id']}/")
        assert d["systemd_unit"] and d["pid"] == serving and d["status"] == "ready"
        assert host.unit(d["systemd_unit"])["UnitFileState"] == "enabled"
        s.say(next(e["message"] for e in reversed(api.events(d["id"])) if e["step"] == "persist"))

    with clock.step("reboot the host") as s:
        marker = Deployment.objects.get(pk=d["id"]).marker
        before = {e["id"] for e in api.events(d["id"])}
        host.reboot([marker])
        adopted = wait_until(
            lambda: next((e for e in api.events(d["id"]) if e["id"] not in before and e["step"] == "adopted"), None),
            timeout=120,
            message="the adoption",
        )
        s.say(adopted["message"])
        d = api.until(
            f"/api/deployments/{d['id']}/",
            lambda x: x["status"] in ("ready", "failed", "stopped"),
            2400,
            "ready again",
            interval=0.5,
        )
        assert d["status"] == "ready", d["status_message"]
        assert d["pid"] == int(host.unit(d["systemd_unit"])["MainPID"]), d["pid"]  # the unit's engine, adopted

    with clock.step("the engine answers through the gateway") as s:
        refused = []

        def called():
            answer = httpx.post(
                f"{host.gateway_url}/v1/chat/completions",
                timeout=120,
                headers={"Authorization": f"Bearer {caller_key}"},
                json={"model": KIMI, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8},
            )
            if answer.status_code != 200:
                refused.append(f"{answer.status_code} {answer.text[:200]}")
            return answer if answer.status_code == 200 else None

        # A key made this morning, the gateway started again with the host: the first call should answer; any refusal
        # before the answer is printed.
        answer = wait_until(called, timeout=30, interval=0.5, message="a 200 from the gateway")
        if refused:
            s.say(f"before answering, the gateway refused the key {len(refused)} times: {refused[0]}")
        message = answer.json()["choices"][0]["message"]
        assert message.get("content") or message.get("reasoning"), message
        s.say(f"gateway {host.gateway_url}: {answer.status_code}, {answer.json()['usage']}")

    print("\n" + clock.summary())


def _pct(x) -> str:
    return "?" if x is None else f"{x:+.1%}"


def _small_files(root) -> int:
    repo = root / KIMI
    return sum(p.stat().st_size for p in repo.iterdir() if p.is_file() and not p.name.endswith(".safetensors"))
