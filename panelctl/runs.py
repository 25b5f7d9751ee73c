"""panelctl bench, runs, compare and export: benchmark runs of a deployment or a URL, and their results.

    panelctl bench qwen3-0-6b-cpu-01 --wait             # twice, then:
    panelctl compare 1 2
"""
import json
import time
from pathlib import Path

from panelctl import rates, slo, workloads
from panelctl.client import FAILED, TIMED_OUT, done, emit, find_deployment, say

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}  # the API's endpoint values


def cmd_bench(panel, args):
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    rate_fields = rates.rate_body(args)
    body = {"max_tokens": args.max_tokens, "input_tokens": args.input_tokens,
            "prompt_source": args.prompts, "ignore_eos": not args.no_ignore_eos, "requests_per_user": args.requests_per_user,
            "stop_when_saturated": not args.past_saturation}
    if args.prompts_file:
        body.update(prompt_source="jsonl", prompts_jsonl=Path(args.prompts_file).read_text())
    if args.target.startswith(("http://", "https://")):
        body.update(base_url=args.target, served_model=args.model or "")
    else:
        body["deployment"] = find_deployment(panel, args.target)["id"]
    if levels:
        body["levels"] = levels
    body.update({"workload": args.workload} if args.workload else {})
    body.update({"request_timeout_s": args.request_timeout} if args.request_timeout is not None else {})
    body.update({field: value for field in ("seed", "temperature", "min_requests", "warmup_per_user", "repeats")
                 if (value := getattr(args, field)) is not None})
    body.update({"endpoint": ENDPOINTS[args.endpoint]} if args.endpoint else {})
    body.update(rate_fields)
    body.update(slo.slo_body(args))
    run = panel.post("runs/", body, key=args.idempotency_key)
    say(f"Run {run['id']}: {slo.asked(run['params'], rates.asked(run['params']))}.")
    if not args.wait:
        return done(run, args)
    deadline, shown = time.monotonic() + args.timeout, set()
    while time.monotonic() < deadline:
        run = panel.get(f"runs/{run['id']}/")
        points = panel.get(f"runs/{run['id']}/points/")
        for p in points:
            if rates.point_key(p) not in shown:
                shown.add(rates.point_key(p))
                asked = p.get("prompt_tokens_requested")
                for line in filter(None, (rates.rate_line(p), workloads.prefix_line(p))):
                    say(line)
                if line := slo.slo_line(p):
                    say(line)
                say(f"  {level_label(p):<7} {p['output_throughput']:>10,.1f} tok/s  TTFT {_ms(p['ttft_ms'], 1)}"
                    f"  TPOT {_ms(p['tpot_ms'], 2)}  {p['tok_s_per_user']:.1f} tok/s per user"
                    f"  prompt {asked if asked is not None else '-'}/{p.get('prompt_tokens_mean', 0):.1f} tokens asked/measured")
                if p.get("failed_requests"):
                    timeouts = f" ({p['timeouts']} timed out)" if p.get("timeouts") else ""
                    timeouts += f" ({p['rejected']} refused for load)" if p.get("rejected") else ""
                    say(f"    {p['failed_requests']} of {p['num_requests']} failed{timeouts}"
                        + (f": {'; '.join(p['errors'])}" if p.get("errors") else ""))
                if line := energy_line(p):
                    say(line)
        if run["status"] in ("done", "failed", "cancelled"):
            if run.get("saturation"):
                say(f"  {run['saturation']['text']}")
            if (run.get("capacity") or {}).get("text"):
                say(run["capacity"]["text"])
            for row in run.get("over_repeats") or []:
                say(repeats_line(row))
            for warning in run.get("warnings") or []:
                say(f"  note: {warning}")
            result = {**run, "points": points}
            emit(result, args.json, [f"Run {run['id']} {run['status']}"
                                     + (f": single stream {run['single_stream_tok_s']:.1f} tok/s" if run["single_stream_tok_s"] else "")
                                     + (f" — {run['error']}" if run["error"] else "")])
            return 0 if run["status"] == "done" else FAILED
        time.sleep(2)
    say(f"Timed out after {args.timeout:.0f} s; the run goes on (panelctl runs).")
    return TIMED_OUT


def level_label(p: dict) -> str:
    """"c=16" for a concurrency level, "4 req/s" for a rate level (its concurrency is a cap, 0 for none); a repeat
    after the first "c=16 #2"."""
    label = f"{p['rate']:g} req/s" if p.get("kind") == "rate" else f"c={p['concurrency']}"
    return label + (f" #{p['repeat'] + 1}" if p.get("repeat") else "")


def repeats_line(row: dict) -> str:
    """A level's output tok/s over its repeats (the run's over_repeats): the median, and its 95 % interval or why
    there is none."""
    tput = row["figures"].get("throughput")
    if not tput:
        return f"  {row['label']} over {row['repeats']} repeats: no output throughput measured"
    spread = f"95 % interval {tput['low']:,.1f} to {tput['high']:,.1f}" if tput["low"] is not None else tput["why"]
    return f"  {row['label']} over {row['repeats']} repeats: {tput['median']:,.1f} output tok/s median ({spread})"


def energy_line(p: dict) -> str | None:
    """What the level's output cost on the deployment's GPUs (NVML's energy counters; none on a CPU node)."""
    if p.get("energy_j") is None or not p.get("output_tokens"):
        return None
    watts = f", {p['watts_per_gpu']:.0f} W per GPU" if p.get("watts_per_gpu") is not None else ""
    net = f", {p['energy_net_j'] / p['output_tokens']:.3f} net of idle" if p.get("energy_net_j") is not None else ""
    return f"  energy {p['energy_j'] / p['output_tokens']:.3f} J per output token{net} ({p['energy_j']:,.0f} J{watts})"


def _ms(quantiles: dict, digits: int) -> str:
    """A median in ms, or a dash where none was measured (a level whose tokens all came in one read has no TPOT:
    never a made-up 0)."""
    return f"{quantiles['median']:.{digits}f} ms" if quantiles.get("median") is not None else "— ms"


def cmd_runs(panel, args):
    runs = panel.get("runs/")["results"]
    emit(runs, args.json, [f"{r['id']:>4} {r['status']:<10} {r['name']}" for r in runs])
    return 0


def cmd_compare(panel, args):
    data = panel.get("runs/compare/", ids=",".join(args.runs))
    lines = []
    for r in data["runs"]:
        best = max((p["output_throughput"] for p in r["points"]), default=0)
        lines.append(f"{r['id']:>4} {r['name']:<40} single {r['single_stream_tok_s'] or 0:8.1f} tok/s  best {best:10,.1f} tok/s")
    lines += [f"     {d['setting']}: {d['a']} -> {d['b']}" for d in data["diff"]]
    emit(data, args.json, lines)
    return 0


def cmd_export(panel, args):
    out = panel.get("runs/export/", ids=",".join(args.runs), **({"as": "csv"} if args.csv else {}))
    print(out if isinstance(out, str) else json.dumps(out, indent=2, default=str))
    return 0


def add(sub) -> None:
    """The `bench`, `runs`, `compare` and `export` subcommands (sub: with the common options)."""
    s = sub.add_parser("bench", help="concurrency sweep of a deployment (name or id) or a URL")
    s.add_argument("target")
    s.add_argument("--model", default="", help="model name for a URL target")
    s.add_argument("--concurrency", default="", help="e.g. 1,8,64 (default: 1, 2, 4, … up to what the deployment "
                   "runs at once, its --max-num-seqs; 64 on a CPU node)")
    rates.rate_arguments(s)
    slo.slo_arguments(s)
    workloads.bench_arguments(s)
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--input-tokens", type=int, default=128)
    s.add_argument("--prompts", choices=["random", "builtin"], default="random")
    s.add_argument("--prompts-file", default="", help='JSONL of {"prompt": ...} or {"messages": [...]} per line')
    s.add_argument("--requests-per-user", type=int, default=4)
    s.add_argument("--no-ignore-eos", action="store_true")
    s.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="how long each request may take (default: its own, from its max tokens)")
    s.add_argument("--seed", type=int, default=None, help="seeds the prompts and the arrivals: the same seed sends "
                   "the same requests (default 0; a run page shows its own line)")
    s.add_argument("--endpoint", choices=["chat", "completions"], default=None, help="the API the requests use "
                   "(default chat)")
    s.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0)")
    s.add_argument("--min-requests", type=int, default=None, help="measured requests of a level at least (default 32)")
    s.add_argument("--warmup-per-user", type=int, default=None, help="unmeasured requests per stream first (default 1)")
    s.add_argument("--repeats", type=int, default=None, help="measure each level this many times, each with its own "
                   "prompts: figures then come with 95 %% intervals (default 1)")
    s.add_argument("--past-saturation", action="store_true",
                   help="measure every level (by default the sweep stops once the engine saturates)")
    s.add_argument("--wait", action="store_true")
    s.add_argument("--timeout", type=float, default=7200)
    s.set_defaults(fn=cmd_bench)
    sub.add_parser("runs", help="benchmark runs").set_defaults(fn=cmd_runs)
    for name, fn in (("compare", cmd_compare), ("export", cmd_export)):
        s = sub.add_parser(name, help=f"{name} runs by id")
        s.add_argument("runs", nargs="+")
        if name == "export":
            s.add_argument("--csv", action="store_true")
        s.set_defaults(fn=fn)
