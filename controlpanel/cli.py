"""panelctl: the panel's REST API from scripts and terminals.

    export PANEL_URL=http://panel:8000 PANEL_TOKEN=...   (or: panelctl login --url ... --token ...)
    panelctl list nodes                                  # what the panel sees (also: models, deployments, runs)
    panelctl model-add Qwen/Qwen3-0.6B                   # then: panelctl list models
    panelctl deploy Qwen/Qwen3-0.6B --node cpu-01 --wait # the node's preset and a free port, as on the form
    panelctl deploy Qwen/Qwen3-0.6B --node cpu-01 --replace --flag max-num-seqs=8 --wait   # redeploy it changed
    panelctl deploy moonshotai/Kimi-K2.5 --node gpu-01 --tp 8 --env NCCL_PROTO=LL --wait
    panelctl deploy moonshotai/Kimi-K2.5 --node gpu-01 --node gpu-02:0,1,2,3,4,5,6,7 --tp 8 --pp 2 --wait  # two nodes
    panelctl status deployment qwen3-0-6b-cpu-01        # endpoint, model name, key, last error, curl/Python
    panelctl bench qwen3-0-6b-cpu-01 --wait             # twice, then:
    panelctl compare 1 2
    panelctl stop qwen3-0-6b-cpu-01 --wait
    panelctl tune start qwen3-0-6b-cpu-01 --vary max-num-seqs=8,16 --concurrency 16 --wait   # see controlpanel/clitune.py

Progress goes to stderr, results to stdout (--json for machines). Exit codes:
  0 done  1 the deploy/benchmark failed  2 bad input  3 conflict (busy, in use)
  4 not logged in or not allowed  5 not found  6 panel unreachable or server error  7 timed out
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

from controlpanel import clirate, clirecipes, clikeys, clisleep, clislo, clistatus, clitune, cliworkload
from controlpanel.clibase import (BAD_INPUT, EXIT, FAILED, NOT_FOUND, NOT_FOUND_CODES, TIMED_OUT,  # noqa: F401
                                  UNREACHABLE, CliError, Panel, _deployment, _done, _emit, _exit_code,
                                  _number, say, with_common)
from plumbing.privatefile import write_private

CONFIG = Path(os.environ.get("PANELCTL_CONFIG", Path.home() / ".config" / "panelctl.json"))


def _pairs(items: list[str], what: str) -> dict:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(f"{what} {item!r}: write NAME=VALUE", BAD_INPUT)
        out[name] = True if value == "" and what == "--flag" else _number(value)
    return out


def _model_id(panel: Panel, ref: str) -> int:
    if ref.isdigit():
        return int(ref)
    found = panel.get("models/", repo_id=ref)["results"]
    if not found:
        raise CliError(f"No model {ref!r} in the panel: add it first (panelctl model-add {ref}), then deploy it.", NOT_FOUND)
    return found[0]["id"]


# --- commands ---------------------------------------------------------------------------------

def cmd_login(panel, args):
    Panel(args.url, args.token).get("nodes/")
    CONFIG.parent.mkdir(parents=True, exist_ok=True)
    write_private(CONFIG, json.dumps({"url": args.url, "token": args.token}))  # 0600 from its first byte
    say(f"Saved to {CONFIG}.")
    return 0


def cmd_nodes(panel, args):
    nodes = panel.get("nodes/")["results"]
    lines = []
    for n in nodes:
        gpus = n["live"]["gpus"] if n.get("live") else []
        mem = ", ".join(f"{g['index']}:{(g['memory_used'] or 0) / 2**30:.0f}/{(g['memory_total'] or 0) / 2**30:.0f} GiB" for g in gpus)
        lines.append(f"{n['name']:<20} {'online' if n['online'] else 'OFFLINE':<8} {len(n['gpus'])} GPU(s) "
                     f"disk free {n['disk_free'] / 2**30:,.1f} GiB  {mem or n['nvml_error'] or ''}")
    _emit(nodes, args.json, lines)
    return 0


def cmd_models(panel, args):
    models = panel.get("models/")["results"]
    _emit(models, args.json, [f"{m['id']:>4} {m['repo_id']:<40} {m['architecture'] or '?':<28} {m['total_size'] / 2**30:,.1f} GiB"
                              for m in models])
    return 0


def cmd_model_add(panel, args):
    model = panel.post("models/", {"repo_id": args.repo_id, "revision": args.revision}, key=args.idempotency_key)
    _emit(model, args.json, [f"Added {model['repo_id']} (id {model['id']}); it is being inspected."])
    return 0


def cmd_model_remove(panel, args):
    """Forget a model the panel holds no copy or deployment of (a repo added by mistake)."""
    panel.call("DELETE", f"models/{_model_id(panel, args.model)}/")
    say(f"Removed {args.model}.")
    return 0


def _deploy_node(panel: Panel, model_id: int) -> str:
    """Without --node: the one node holding a ready copy of the model, or the only node there is."""
    ready = sorted({c["node"] for c in panel.get(f"models/{model_id}/").get("copies", []) if c["state"] == "ready"})
    if len(ready) == 1:
        return ready[0]
    names = [n["name"] for n in panel.get("nodes/")["results"]]
    if len(names) == 1 and not ready:
        return names[0]
    raise CliError(f"Give --node: {'copies are ready on ' + ', '.join(ready) if ready else 'the nodes are ' + ', '.join(names) or 'no node yet'}.", 2)


def _indices(text: str, what: str) -> list[int]:
    try:
        return [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise CliError(f"{what}: GPU indices are numbers separated by commas, e.g. 0,1 (got {text!r}).", 2) from None


def _placement(values: list[str]) -> dict:
    """--node a --node b:0,1 → {"a": None, "b": [0, 1]} in order (None: GPUs from --gpus or the default)."""
    placement = {}
    for value in values:
        name, _, gpus = value.partition(":")
        if name in placement:
            raise CliError(f"--node {name} is given twice: each node appears once (the first is the head).", 2)
        placement[name] = _indices(gpus, f"--node {value}") if gpus else None
    return placement


def cmd_deploy(panel, args):
    model_id = _model_id(panel, args.model)
    placement = _placement(args.node or [_deploy_node(panel, model_id)])
    args.node = list(placement)
    head, *others = args.node  # --node a --node b: a multi-node deployment, a the head
    node = panel.get(f"nodes/{head}/")
    engine_args = _pairs(args.flag, "--flag")
    for flag, value in (("tensor-parallel-size", args.tp), ("pipeline-parallel-size", args.pp),
                        ("data-parallel-size", args.dp), ("max-model-len", args.max_model_len)):
        if value:  # unset: the server's preset for the node decides, as on the deploy form
            engine_args[flag] = value
    per_node = max(1, (args.tp or 1) * (args.pp or 1) * (args.dp or 1) // len(args.node))

    def gpus_on(name: str, info: dict | None = None) -> list[int]:
        """NAME:0,1 names them; else --gpus; else the node's first TP×PP / nodes GPUs."""
        if placement[name] is not None:
            return placement[name]
        if args.gpus:
            return _indices(args.gpus, "--gpus")
        return [g["index"] for g in (info or panel.get(f"nodes/{name}/"))["gpus"]][:per_node]

    # With a recipe and no GPUs named, the server takes the recipe's (its TP size may be pinned below the count).
    gpus = [] if args.recipe and not args.gpus and placement[head] is None else gpus_on(head, node)
    workers = [{"node": name, "gpus": gpus_on(name)} for name in others]
    body = {"model": model_id, "node": head, "gpus": gpus, "workers": workers, "port": args.port, "engine_args": engine_args,
            "env": {k: str(v) for k, v in _pairs(args.env, "--env").items()}, "auto_restart": args.auto_restart,
            "preset": args.preset, "replace_existing": args.replace, "secret_env": args.secret_env or [],
            "stop_foreign": args.stop_foreign, "override_fit": args.override_fit,
            "reuse_memory_profile": args.reuse_memory_profile,
            "replace": [_deployment(panel, r)["id"] for r in args.also_stop or []], **clirecipes.deploy_body(args),
            **clisleep.deploy_body(args)}
    body.update(aliases=args.alias or [], max_in_flight=args.max_in_flight, queue_bound=args.queue_bound,
                media_domains=args.media_domain or [])  # the gateway's route (deployments/gateway/keys.py checks)
    if others and args.master_port:
        body["master_port"] = args.master_port
    if args.name:
        body["name"] = args.name
    try:
        d = panel.post("deployments/", body, key=args.idempotency_key)
    except CliError as exc:
        if exc.code == 3 and "exists already" in str(exc):
            raise CliError(f"{exc}\n  (run again with --replace to redeploy it with these settings)", exc.code) from exc
        raise
    say(f"Deploying {d['name']} (id {d['id']}) on {' + '.join(args.node)}, GPUs {d['gpus'] or 'none (CPU)'}, port {d['port']}, flags "
        + " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in d["engine_args"].items()))
    return _wait_deployment(panel, d, args, want="ready") if args.wait else _done(d, args)


def _wait_deployment(panel: Panel, d: dict, args, want: str, since: str = "queued") -> int:
    return clistatus.wait_deployment(panel, d, args, want, since)


def cmd_stop(panel, args):
    d = _deployment(panel, args.deployment)
    d = panel.post(f"deployments/{d['id']}/stop/", key=args.idempotency_key)
    say(f"Stopping {d['name']}.")
    return _wait_deployment(panel, d, args, want="stopped", since="stop") if args.wait else _done(d, args)


def cmd_restart(panel, args):
    d = _deployment(panel, args.deployment)
    d = panel.post(f"deployments/{d['id']}/restart/", key=args.idempotency_key)
    return _wait_deployment(panel, d, args, want="ready") if args.wait else _done(d, args)


def cmd_logs(panel, args):
    d = _deployment(panel, args.deployment)
    lines = panel.get(f"deployments/{d['id']}/logs/")["lines"]
    print("\n".join(lines[-args.lines:]))
    return 0


def cmd_bench(panel, args):
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    rates = clirate.rate_body(args)
    body = {"max_tokens": args.max_tokens, "input_tokens": args.input_tokens,
            "prompt_source": args.prompts, "ignore_eos": not args.no_ignore_eos, "requests_per_user": args.requests_per_user,
            "stop_when_saturated": not args.past_saturation}
    if args.prompts_file:
        body.update(prompt_source="jsonl", prompts_jsonl=Path(args.prompts_file).read_text())
    if args.target.startswith(("http://", "https://")):
        body.update(base_url=args.target, served_model=args.model or "")
    else:
        body["deployment"] = _deployment(panel, args.target)["id"]
    if levels:
        body["levels"] = levels
    body.update({"workload": args.workload} if args.workload else {})
    body.update(rates)
    body.update(clislo.slo_body(args))
    run = panel.post("runs/", body, key=args.idempotency_key)
    say(f"Run {run['id']}: {clislo.asked(run['params'], clirate.asked(run['params']))}.")
    if not args.wait:
        return _done(run, args)
    deadline, shown = time.monotonic() + args.timeout, set()
    while time.monotonic() < deadline:
        run = panel.get(f"runs/{run['id']}/")
        points = panel.get(f"runs/{run['id']}/points/")
        for p in points:
            if clirate.point_key(p) not in shown:
                shown.add(clirate.point_key(p))
                asked = p.get("prompt_tokens_requested")
                for line in filter(None, (clirate.rate_line(p), cliworkload.prefix_line(p))):
                    say(line)
                if line := clislo.slo_line(p):
                    say(line)
                say(f"  c={p['concurrency']:<5} {p['output_throughput']:>10,.1f} tok/s  TTFT {_ms(p['ttft_ms'], 1)}"
                    f"  TPOT {_ms(p['tpot_ms'], 2)}  {p['tok_s_per_user']:.1f} tok/s per user"
                    f"  prompt {asked if asked is not None else '-'}/{p.get('prompt_tokens_mean', 0):.1f} tokens asked/measured")
        if run["status"] in ("done", "failed", "cancelled"):
            if run.get("saturation"):
                say(f"  {run['saturation']['text']}")
            if (run.get("capacity") or {}).get("text"):
                say(run["capacity"]["text"])
            for warning in run.get("warnings") or []:
                say(f"  note: {warning}")
            result = {**run, "points": points}
            _emit(result, args.json, [f"Run {run['id']} {run['status']}"
                                      + (f": single stream {run['single_stream_tok_s']:.1f} tok/s" if run["single_stream_tok_s"] else "")
                                      + (f" — {run['error']}" if run["error"] else "")])
            return 0 if run["status"] == "done" else FAILED
        time.sleep(2)
    say(f"Timed out after {args.timeout:.0f} s; the run goes on (panelctl runs).")
    return TIMED_OUT


def _ms(quantiles: dict, digits: int) -> str:
    """A median in ms, or a dash where none was measured (a level whose tokens all came in one read has no TPOT:
    never a made-up 0)."""
    return f"{quantiles['median']:.{digits}f} ms" if quantiles.get("median") is not None else "— ms"


def cmd_deployments(panel, args):
    items = panel.get("deployments/")["results"]
    _emit(items, args.json, [f"{d['id']:>4} {d['name']:<32} {d['status']:<10} {d['node']:<16} port {d['port']:<6} "
                             f"GPUs {','.join(map(str, d['gpus'])) or 'none (CPU)'}" for d in items])
    return 0


LISTS = {"nodes": cmd_nodes, "models": cmd_models, "deployments": cmd_deployments}


def cmd_list(panel, args):
    return (LISTS.get(args.kind) or cmd_runs)(panel, args)


def cmd_status(panel, args):
    """One object in full: a deployment or node by name, a model by repo id, a run by id."""
    if args.kind == "deployment":
        item = _deployment(panel, args.ref)
        lines = clistatus.deployment_lines(panel, item)
    elif args.kind == "node":
        item = panel.get(f"nodes/{args.ref}/")
        lines = [f"{item['name']}: {'online' if item['online'] else 'OFFLINE'}, {len(item['gpus'])} GPU(s), "
                 f"disk free {item['disk_free'] / 2**30:,.1f} GiB"]
    elif args.kind == "model":
        item = panel.get(f"models/{_model_id(panel, args.ref)}/")
        lines = [f"{item['repo_id']}: {item['architecture'] or '?'}, {item['total_size'] / 2**30:,.1f} GiB"]
    else:
        item = panel.get(f"runs/{args.ref}/")
        lines = [f"Run {item['id']} {item['status']}: {item['name']}"]
    _emit(item, args.json, lines)
    return 0


def cmd_runs(panel, args):
    runs = panel.get("runs/")["results"]
    _emit(runs, args.json, [f"{r['id']:>4} {r['status']:<10} {r['name']}" for r in runs])
    return 0


def cmd_compare(panel, args):
    data = panel.get("runs/compare/", ids=",".join(args.runs))
    lines = []
    for r in data["runs"]:
        best = max((p["output_throughput"] for p in r["points"]), default=0)
        lines.append(f"{r['id']:>4} {r['name']:<40} single {r['single_stream_tok_s'] or 0:8.1f} tok/s  best {best:10,.1f} tok/s")
    lines += [f"     {d['setting']}: {d['a']} -> {d['b']}" for d in data["diff"]]
    _emit(data, args.json, lines)
    return 0


def cmd_export(panel, args):
    out = panel.get("runs/export/", ids=",".join(args.runs), **({"as": "csv"} if args.csv else {}))
    print(out if isinstance(out, str) else json.dumps(out, indent=2, default=str))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="panelctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="panel URL (PANEL_URL)")
    p.add_argument("--token", default=None, help="API token (PANEL_TOKEN)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print results as JSON")
    common.add_argument("--idempotency-key", default=None, help="retry-safe key for calls that start work")
    sub = with_common(p.add_subparsers(dest="command", required=True), common)

    s = sub.add_parser("login", help="save the panel URL and token")
    s.add_argument("--url", required=True, dest="url")
    s.add_argument("--token", required=True, dest="token")
    s.set_defaults(fn=cmd_login)
    sub.add_parser("nodes", help="nodes, their GPUs' memory and disk").set_defaults(fn=cmd_nodes)
    sub.add_parser("models", help="models in the panel").set_defaults(fn=cmd_models)
    s = sub.add_parser("model-add", help="add a Hugging Face repo")
    s.add_argument("repo_id")
    s.add_argument("--revision", default="main")
    s.set_defaults(fn=cmd_model_add)
    s = sub.add_parser("model-remove", help="forget a model without copies or deployments (id or repo id)")
    s.add_argument("model")
    s.set_defaults(fn=cmd_model_remove)

    s = sub.add_parser("deploy", help="deploy a model (id or repo id) to a node")
    s.add_argument("model")
    s.add_argument("--node", action="append", default=[],
                   help="default: the node with a ready copy of the model (or the only node); repeat for a "
                        "multi-node deployment: the first is the head, the others run headless ranks; "
                        "NAME:0,1 picks that node's GPUs")
    s.add_argument("--master-port", type=int, default=None, help="multi-node: the head's port the ranks meet at "
                   "(its DP RPC port with --dp above 1)")
    s.add_argument("--name", default="")
    s.add_argument("--gpus", default="", help="e.g. 0,1,2,3 (default: the first TP×PP GPUs)")
    s.add_argument("--tp", type=int, default=None, help="tensor parallel (default: the preset's)")
    s.add_argument("--pp", type=int, default=None, help="pipeline parallel (default: 1)")
    s.add_argument("--dp", type=int, default=None, help="data-parallel replicas of TP×PP GPUs (default: 1); over "
                   "several nodes each node runs whole replicas")
    s.add_argument("--port", type=int, default=None, help="default: a port free on the node")
    s.add_argument("--preset", default="auto", help="auto (the node's: one GPU, or the CPU engine), none, or a "
                   "deploy-form preset: single-gpu, tp8-moe-int4, tp4-ep-fp8, nccl-ring-ll, cpu-test")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--flag", action="append", metavar="NAME=VALUE", help="engine flag, repeatable (NAME= for a switch)")
    s.add_argument("--env", action="append", metavar="NAME=VALUE", help="environment variable, repeatable")
    s.add_argument("--secret-env", action="append", metavar="NAME",
                   help="keep this --env variable secret (masked everywhere), repeatable")
    s.add_argument("--replace", action="store_true", help="a deployment with this name exists: redeploy it")
    s.add_argument("--also-stop", action="append", metavar="DEPLOYMENT", help="also stop this deployment first")
    s.add_argument("--auto-restart", action="store_true")
    s.add_argument("--reuse-memory-profile", action="store_true", help="start with the KV cache size the last load "
                   "of this model, GPUs, settings and engine chose (no profiling run); refused when none matches")
    s.add_argument("--stop-foreign", action="store_true", help="stop processes the panel did not start that hold "
                   "the chosen GPUs (a node without GPUs: other vLLM engines on it); without it such a deploy is refused")
    s.add_argument("--override-fit", action="store_true", help="deploy although the fit check says it does not fit "
                   "(admins only, recorded on the timeline); without it such a deploy is refused (exit 3)")
    s.add_argument("--alias", action="append", metavar="NAME", help="another model name callers may use at the "
                   "gateway (e.g. kimi), repeatable: the name follows a swap")
    s.add_argument("--max-in-flight", type=int, default=None, help="requests the gateway sends to it at once "
                   "(default: its --max-num-seqs)")
    s.add_argument("--queue-bound", type=int, default=None, help="requests waiting in the gateway beyond that "
                   "(default 256); then 429")
    s.add_argument("--media-domain", action="append", metavar="DOMAIN", help="a domain multimodal URLs may come "
                   "from, repeatable (default: data: URLs only)")
    clirecipes.deploy_arguments(s)
    clisleep.deploy_arguments(s)
    s.add_argument("--wait", action="store_true", help="wait until ready (exit 1 if it fails)")
    s.add_argument("--timeout", type=float, default=7200)
    s.set_defaults(fn=cmd_deploy)
    for name, fn, want in (("stop", cmd_stop, "stopped"), ("restart", cmd_restart, "ready")):
        s = sub.add_parser(name, help=f"{name} a deployment (name or id)")
        s.add_argument("deployment")
        s.add_argument("--wait", action="store_true", help=f"wait until {want}")
        s.add_argument("--timeout", type=float, default=7200 if want == "ready" else 300)
        s.set_defaults(fn=fn)
    s = sub.add_parser("logs", help="a deployment's engine log")
    s.add_argument("deployment")
    s.add_argument("-n", "--lines", type=int, default=100)
    s.set_defaults(fn=cmd_logs)

    s = sub.add_parser("bench", help="concurrency sweep of a deployment (name or id) or a URL")
    s.add_argument("target")
    s.add_argument("--model", default="", help="model name for a URL target")
    s.add_argument("--concurrency", default="", help="e.g. 1,8,64 (default: 1, 2, 4, … up to what the deployment "
                   "runs at once, its --max-num-seqs; 64 on a CPU node)")
    clirate.rate_arguments(s)
    clislo.slo_arguments(s)
    cliworkload.bench_arguments(s)
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--input-tokens", type=int, default=128)
    s.add_argument("--prompts", choices=["random", "builtin"], default="random")
    s.add_argument("--prompts-file", default="", help='JSONL of {"prompt": ...} or {"messages": [...]} per line')
    s.add_argument("--requests-per-user", type=int, default=4)
    s.add_argument("--no-ignore-eos", action="store_true")
    s.add_argument("--past-saturation", action="store_true",
                   help="measure every level (by default the sweep stops once the engine saturates)")
    s.add_argument("--wait", action="store_true")
    s.add_argument("--timeout", type=float, default=7200)
    s.set_defaults(fn=cmd_bench)
    sub.add_parser("runs", help="benchmark runs").set_defaults(fn=cmd_runs)
    sub.add_parser("deployments", help="deployments, their status, node, port and GPUs").set_defaults(fn=cmd_deployments)
    s = sub.add_parser("list", help="list nodes, models, deployments or runs (a table, or --json)")
    s.add_argument("kind", choices=["nodes", "models", "deployments", "runs"])
    s.set_defaults(fn=cmd_list)
    s = sub.add_parser("status", help="one deployment, node, model (repo id) or run (id) in full")
    s.add_argument("kind", choices=["deployment", "node", "model", "run"])
    s.add_argument("ref")
    s.set_defaults(fn=cmd_status)
    for name, fn in (("compare", cmd_compare), ("export", cmd_export)):
        s = sub.add_parser(name, help=f"{name} runs by id")
        s.add_argument("runs", nargs="+")
        if name == "export":
            s.add_argument("--csv", action="store_true")
        s.set_defaults(fn=fn)
    clisleep.add(sub)
    clitune.add(sub, common)
    clirecipes.add(sub, common)
    clikeys.add(sub, common)
    cliworkload.add(sub)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    saved = json.loads(CONFIG.read_text()) if CONFIG.exists() else {}
    url = args.url or os.environ.get("PANEL_URL") or saved.get("url", "")
    token = args.token or os.environ.get("PANEL_TOKEN") or saved.get("token", "")
    try:
        return args.fn(Panel(url, token) if args.command != "login" else None, args)
    except CliError as exc:
        say(f"panelctl: {exc}")
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
