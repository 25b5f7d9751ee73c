"""panelctl deploy, stop, restart, logs and deployments: a deployment's life from the terminal.

    panelctl deploy Qwen/Qwen3-0.6B --node cpu-01 --wait # the node's preset and a free port, as on the form
    panelctl deploy moonshotai/Kimi-K2.5 --node gpu-01 --node gpu-02:0,1,2,3,4,5,6,7 --tp 8 --pp 2 --wait  # two nodes
    panelctl stop qwen3-0-6b-cpu-01 --wait
"""
from panelctl import models, recipes, sleep, status
from panelctl.client import BAD_INPUT, CliError, Panel, done, emit, find_deployment, number, say


def _pairs(items: list[str], what: str) -> dict:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(f"{what} {item!r}: write NAME=VALUE", BAD_INPUT)
        out[name] = True if value == "" and what == "--flag" else number(value)
    return out


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
    model_id = models.model_id(panel, args.model)
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
            "retry_advised": args.retry_advised, "preset": args.preset, "replace_existing": args.replace, "secret_env": args.secret_env or [],
            "stop_foreign": args.stop_foreign, "override_fit": args.override_fit,
            "reuse_memory_profile": args.reuse_memory_profile,
            "replace": [find_deployment(panel, r)["id"] for r in args.also_stop or []], **recipes.deploy_body(args),
            **sleep.deploy_body(args)}
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
    return status.wait_deployment(panel, d, args, want="ready") if args.wait else done(d, args)


def cmd_stop(panel, args):
    return status.deployment_action(panel, args, "stop", want="stopped", since="stop",
                                    saying=lambda d: f"Stopping {d['name']}.")


def cmd_restart(panel, args):
    return status.deployment_action(panel, args, "restart", want="ready")


def cmd_logs(panel, args):
    d = find_deployment(panel, args.deployment)
    lines = panel.get(f"deployments/{d['id']}/logs/")["lines"]
    print("\n".join(lines[-args.lines:]))
    return 0


def cmd_deployments(panel, args):
    items = panel.get("deployments/")["results"]
    emit(items, args.json, [f"{d['id']:>4} {d['name']:<32} {d['status']:<10} {d['node']:<16} port {d['port']:<6} "
                            f"GPUs {','.join(map(str, d['gpus'])) or 'none (CPU)'}" for d in items])
    return 0


def add(sub) -> None:
    """The `deploy`, `stop`, `restart`, `logs` and `deployments` subcommands (sub: with the common options)."""
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
    s.add_argument("--no-retry-advised", dest="retry_advised", action="store_false", help="a start that runs out of "
                   "memory or KV cache is not started once more with the setting its log advises (it is by default)")
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
    recipes.deploy_arguments(s)
    sleep.deploy_arguments(s)
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
    sub.add_parser("deployments", help="deployments, their status, node, port and GPUs").set_defaults(fn=cmd_deployments)
