"""panelctl: named workloads (shared prefixes, multi-turn, ShareGPT, Mooncake traces) and bench --workload.

    panelctl workload add chats --kind multiturn --turns 5 --think-s 2 --input-tokens 200 --max-tokens 100
    panelctl workload add chats2 --kind multiturn --turns 5 --think uniform --think-min-s 1 --think-max-s 5 --think-seed 7
    panelctl workload add yesterday --kind trace --file mooncake.jsonl
    panelctl bench qwen3-0-6b-cpu-01 --workload yesterday --rate 2,4,8 --wait
"""
from pathlib import Path

from panelctl.client import emit


def cmd_workload_add(panel, args):
    body = {"name": args.name, "kind": args.kind}
    for name in ("prefixes", "prefix_tokens", "turns", "think_s", "think", "think_min_s", "think_max_s", "think_seed",
                 "input_tokens", "max_tokens"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.file:
        body["file"] = Path(args.file).read_text()
    w = panel.post("workloads/", body, key=args.idempotency_key)
    emit(w, args.json, [f"Workload {w['id']} {w['name']} ({w['kind']}): {preview_line(w['preview'])}"])
    return 0


def cmd_workloads(panel, args):
    found = panel.get("workloads/")
    rows = found["results"] if isinstance(found, dict) else found
    emit(rows, args.json, [f"{w['id']:>4}  {w['name']:<24} {w['kind']:<10} {preview_line(w['preview'])}"
                           for w in rows] or ["No workloads."])
    return 0


def preview_line(p: dict) -> str:
    """'prompts 24-84 tokens (p50 54), outputs 6, a prefix cache could serve 47.2 %', and a trace's rate."""
    if not p:
        return "preview being made (a few seconds; `panelctl workloads` again)"
    if p.get("error"):
        return p["error"]
    parts = []
    if tokens := p.get("prompt_tokens") or p.get("prompt_words"):
        unit = "tokens" if "prompt_tokens" in p else "words"
        parts.append(f"prompts {tokens['min']:g}-{tokens['max']:g} {unit} (p50 {tokens['p50']:g})")
    if out := p.get("output_tokens"):
        parts.append(f"outputs {out['min']:g}-{out['max']:g}" if out["min"] != out["max"] else f"outputs {out['min']:g}")
    if "rate" in p:
        parts.append(f"{p['requests']} requests over {p['duration_s']:g} s ({p['rate']:g} req/s at 1x)")
    if drawn := (p.get("think") or {}).get("drawn_s"):
        parts.append(f"think {p['think']['think']} (drawn p10 {drawn['p10']:g}, p50 {drawn['p50']:g}, p90 {drawn['p90']:g} s)")
    if reuse := p.get("prefix_reuse"):
        parts.append(f"a prefix cache could serve {100 * reuse['share']:.1f} %")
    return ", ".join(parts)


def prefix_line(point: dict) -> str:
    """A level's prefix cache: the engine's own hit rate next to what the workload could have reused."""
    cache, reuse = (point.get("server_metrics") or {}).get("prefix_cache"), point.get("prefix_reuse") or {}
    if not cache and not reuse:
        return ""
    engine = f"engine hit {100 * cache['hit_rate']:.1f} % of {cache['queries']:,.0f} prompt tokens" if cache else \
        "the engine reports no prefix-cache counters"
    could = f"; the workload could reuse {100 * reuse['share']:.1f} %" if reuse else ""
    return f"  prefix cache: {engine}{could}"


def bench_arguments(s) -> None:
    s.add_argument("--workload", default="", help="a named workload (panelctl workloads): its prompts and lengths; "
                   "a trace without --rate or --concurrency replays at its own rate")


def add(sub) -> None:
    """The `workloads` and `workload add` subcommands (sub: with the common options)."""
    sub.add_parser("workloads", help="named workloads and their previews").set_defaults(fn=cmd_workloads)
    s = sub.add_parser("workload", help="add a named workload")
    s.add_argument("action", choices=["add"])
    s.add_argument("name")
    s.add_argument("--kind", required=True, choices=["prefix", "multiturn", "sharegpt", "trace"])
    s.add_argument("--prefixes", type=int, help="prefix: how many shared prefixes")
    s.add_argument("--prefix-tokens", type=int, help="prefix: tokens of each")
    s.add_argument("--turns", type=int, help="multiturn: turns per conversation")
    s.add_argument("--think-s", type=float, help="multiturn: seconds between an answer and the next turn (an exponential's mean)")
    s.add_argument("--think", choices=["fixed", "exponential", "uniform"], help="multiturn: how the think time is drawn")
    s.add_argument("--think-min-s", type=float, help="multiturn, uniform think time: the shortest")
    s.add_argument("--think-max-s", type=float, help="multiturn, uniform think time: the longest")
    s.add_argument("--think-seed", type=int, help="multiturn: seeds the think-time draws")
    s.add_argument("--input-tokens", type=int, help="each suffix or user message")
    s.add_argument("--max-tokens", type=int, help="each answer")
    s.add_argument("--file", default="", help="sharegpt: a ShareGPT JSON/JSONL; trace: a Mooncake JSONL")
    s.set_defaults(fn=cmd_workload_add)
