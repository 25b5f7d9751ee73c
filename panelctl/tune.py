"""panelctl tune: tuning studies from the terminal, through the REST API.

    panelctl tune start qwen3-cpu-01 --vary NCCL_PROTO=LL,LL128,Simple --vary max-num-seqs=8,16 \\
        --concurrency 1,16 --repeats 3 --dry-run           # count and estimate only
    panelctl tune start qwen3-cpu-01 --vary max-num-seqs=8,64 --rate 2,8 --rule throughput:8/s   # rate levels
    panelctl tune start qwen3-cpu-01 --variant "max-num-seqs=16" --variant "max-num-seqs=1 NCCL_ALGO=Ring" --wait
    panelctl tune status 3 [--wait]                        # the matrix, verdicts, winner and winner per level
    panelctl tune pause|resume|cancel 3
    panelctl tune apply 3 [--variant ID | --level 16] [--persist] [--yes]   # --yes: confirm NCCL debugging variables

Upper-case names are environment variables, the others engine flags (NAME= for a switch, NAME=false
to remove one). Exit codes as for the rest of panelctl; `status --wait` exits 1 when the study failed.
"""
import time

from panelctl import client, rates

TERMINAL = ("done", "failed", "cancelled")


def _settings(words: list[str]) -> dict:
    """["max-num-seqs=16", "NCCL_PROTO=LL"] -> {"engine_args": {...}, "env": {...}}."""
    out = {"engine_args": {}, "env": {}}
    for word in words:
        name, sep, value = word.partition("=")
        if not sep or not name:
            raise client.CliError(f"{word!r}: write NAME=VALUE", client.BAD_INPUT)
        if name.isupper():
            out["env"][name] = value
        else:
            out["engine_args"][name.lstrip("-")] = True if value == "" else client.number(value)
    return out


def _level(text: str):
    """A rule's level: a concurrency (16) or a rate ("4/s", which the panel checks); None if neither."""
    if text.isdigit():
        return int(text)
    return text if text.endswith("/s") and len(text) > 2 else None


def _rule(text: str) -> dict:
    kind, _, rest = text.partition(":")
    if kind == "single_stream":
        return {"kind": "single_stream"}
    if kind == "throughput" and _level(rest) is not None:
        return {"kind": "throughput", "level": _level(rest)}
    level, _, budget = rest.partition(":")
    if kind == "ttft" and _level(level) is not None:
        try:
            return {"kind": "throughput_under_ttft", "level": _level(level), "ttft_p95_ms": float(budget)}
        except ValueError:
            pass
    raise client.CliError(f"--rule {text!r}: throughput:LEVEL, single_stream or ttft:LEVEL:P95_MS (a LEVEL is a "
                          "concurrency, 16, or a rate, 4/s)", client.BAD_INPUT)


def _body(panel, args) -> dict:
    dimensions = {}
    for item in args.vary or []:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise client.CliError(f"--vary {item!r}: write NAME=V1,V2,…", client.BAD_INPUT)
        dimensions[name] = [client.number(v) if not name.isupper() else v for v in values.split(",")]
    variants = [{"name": "", **_settings(text.split())} for text in args.variant or []]
    workload = {"max_tokens": args.max_tokens, "input_tokens": args.input_tokens, "requests_per_user": args.requests_per_user}
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if levels:
        workload["levels"] = levels
    workload.update(rates.rate_body(args))  # --rate 2,4,8 and its arrivals, as panelctl bench sends them
    body = {"deployment": client.find_deployment(panel, args.deployment)["id"], "variants": variants,
            "dimensions": dimensions, "workload": workload, "repeats": args.repeats, "max_repeats": args.max_repeats,
            "order": args.order,
            "finish_with": args.finish_with, "name": args.name}
    if args.rule:
        body["rule"] = _rule(args.rule)
    return body


def cmd_start(panel, args):
    body = _body(panel, args)
    preview = panel.post("studies/preview/", body)
    client.say(f"{preview['variants']} variants ({', '.join(preview['names'])}), {preview['trials']} trials, "
               f"about {preview['estimate_s'] / 60:.1f} min ({preview['basis']}).")
    for key in ("adaptive", "warning"):
        if preview.get(key):
            client.say(f"Note: {preview[key]}")
    if args.dry_run:
        client.emit(preview, args.json, [])
        return 0
    study = panel.post("studies/", body, key=args.idempotency_key)
    client.say(f"Study {study['id']} started.")
    return _follow(panel, study["id"], args) if args.wait else client.done(study, args)


def _label(level) -> str:
    """A level as the study page shows it: "c=16", or a rate "4/s" as "4 req/s"."""
    return f"{level[:-2]} req/s" if isinstance(level, str) and level.endswith("/s") else f"c={level}"


def _lines(study: dict) -> list[str]:
    live = study["live"]
    results = live.get("results") or {}
    out = [f"Study {study['id']} {study['status']}: {live['trials_done']}/{live['trials_total']} trials"
           + (f", about {live['left_s'] / 60:.1f} min left" if live.get("left_s") is not None else "")
           + (f" — {study['error']}" if study["error"] else "")]
    levels = live["levels"]
    for v in live["variants"]:
        cells = []
        for level in levels:
            got = [t["points"].get(str(level), {}).get("tok_s") for t in live["trials"] if t["variant"] == v["id"]]
            cells.append(f"{_label(level)}: " + " ".join("·" if x is None else f"{x:,.0f}" for x in got))
        out.append(f"  {v['name'][:40]:<40} " + ("FAILED: " + v["failed"][:80] if v["failed"] else "  ".join(cells)))
    for row in results.get("variants", []):
        if row["is_baseline"]:
            continue
        for key, cmp in sorted(row["comparisons"].items()):
            if not key.startswith("throughput@") or not cmp:
                continue
            rel = cmp["rel"]
            interval = f" [{cmp['rel_low'] * 100:+.1f} %, {cmp['rel_high'] * 100:+.1f} %]" if cmp.get("rel_low") is not None else ""
            out.append(f"  {row['name'][:40]:<40} output tok/s {key.split('@')[1]:>5}: "
                       f"{(rel or 0) * 100:+.1f} %{interval} {cmp['verdict']}" + (f" ({cmp['why']})" if cmp.get("why") else ""))
    if adaptive := results.get("adaptive"):
        out.append(f"Adaptive, {adaptive['repeats']} to {adaptive['max_repeats']} repeats: " + (
            f"{adaptive['repeats_done']} run, stopped {adaptive['stopped']}" if adaptive["stopped"] else
            f"after {adaptive['repeats_done']} still undecided: {', '.join(adaptive['undecided'])}; another round")
            + f" (intervals at z = {adaptive['z']}).")
    if study.get("rule_text"):
        out.append(f"Winner rule: {study['rule_text']}.")
    if results.get("winner"):
        name = next((v["name"] for v in live["variants"] if v["id"] == results["winner"]), "?")
        out.append(f"Winner: {name} ({results.get('winner_why', '')})")
    per_level = results.get("per_level") or {}
    for item in per_level.get("levels") or []:
        out.append(f"  at {item.get('label') or _label(item['level'])}: {item['name'] or '-'}")
    if per_level.get("crossover") or per_level.get("note"):
        out.append(per_level.get("crossover") or per_level["note"])
    if study.get("took_s") and study.get("estimate_s"):
        out.append(f"Took {study['took_s'] / 60:.1f} min (estimated {study['estimate_s'] / 60:.1f} min"
                   + (f", {study['estimate_basis']}" if study.get("estimate_basis") else "") + ").")
    return out


def _follow(panel, study_id: int, args) -> int:
    deadline, done = time.monotonic() + args.timeout, -1
    while time.monotonic() < deadline:
        study = panel.get(f"studies/{study_id}/")
        if study["live"]["trials_done"] != done:
            done = study["live"]["trials_done"]
            left = study["live"].get("left_s")
            client.say(f"  {done}/{study['live']['trials_total']} trials, {study['status']}"
                       + (f", about {left / 60:.1f} min left" if left is not None else ""))
        if study["status"] in TERMINAL:
            client.emit(study, args.json, _lines(study))
            return 0 if study["status"] != "failed" else client.FAILED
        time.sleep(2)
    client.say(f"Timed out after {args.timeout:.0f} s; the study goes on (panelctl tune status {study_id}).")
    return client.TIMED_OUT


def cmd_status(panel, args):
    if args.wait:
        return _follow(panel, args.study, args)
    study = panel.get(f"studies/{args.study}/")
    client.emit(study, args.json, _lines(study))
    return 0


def cmd_control(panel, args):
    study = panel.post(f"studies/{args.study}/{args.action}/", key=args.idempotency_key)
    client.emit(study, args.json, [f"Study {study['id']}: {study['status']}"])
    return 0


def cmd_apply(panel, args):
    body = {"persist": args.persist, "confirm_debug": args.yes}
    if args.variant:
        body["variant"] = args.variant
    if args.level:
        body["level"] = args.level
    answer = panel.post(f"studies/{args.study}/apply/", body, key=args.idempotency_key)
    client.emit(answer, args.json, [f"Redeploying with {answer['name']} (deployment {answer['deployment']})."])
    return 0


def cmd_list(panel, args):
    items = panel.get("studies/")["results"]
    client.emit(items, args.json, [f"{s['id']:>4}  {s['status']:<10} {s['name']}" for s in items])
    return 0


def add(sub, common) -> None:
    """Register `panelctl tune ...` on panelctl's subcommands (`common`: the --json and --idempotency-key parent)."""
    tune = sub.add_parser("tune", help="tuning studies: variants redeployed, benchmarked in repeats, judged")
    actions = client.with_common(tune.add_subparsers(dest="action", required=True), common)
    s = actions.add_parser("start", help="start a study of a deployment (name or id)")
    s.add_argument("deployment")
    s.add_argument("--variant", action="append", metavar="'NAME=VALUE …'", help="one variant's changes, repeatable")
    s.add_argument("--vary", action="append", metavar="NAME=V1,V2", help="a dimension: every combination is a variant")
    s.add_argument("--concurrency", default="", help="levels, e.g. 1,16 (default: as for panelctl bench)")
    rates.rate_arguments(s)
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--input-tokens", type=int, default=128)
    s.add_argument("--requests-per-user", type=int, default=4)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--max-repeats", type=int, default=0, help="adaptive: judged after --repeats and after each round "
                   "more, ended once every variant is decided or at this many (default 0: --repeats, no more)")
    s.add_argument("--order", choices=["interleaved", "mirrored", "random_blocks"], default="interleaved")
    s.add_argument("--rule", default="", help="throughput:LEVEL (default: the highest "
                   "concurrency, else rate), single_stream, ttft:LEVEL:P95_MS; a LEVEL is a concurrency (16) or a rate (4/s)")
    s.add_argument("--finish-with", choices=["baseline", "winner"], default="baseline")
    s.add_argument("--name", default="")
    s.add_argument("--dry-run", action="store_true", help="print the count and the estimate, start nothing")
    s.add_argument("--wait", action="store_true")
    s.add_argument("--timeout", type=float, default=7 * 24 * 3600)
    s.set_defaults(fn=cmd_start)
    s = actions.add_parser("status", help="a study's matrix, verdicts and winner")
    s.add_argument("study", type=int)
    s.add_argument("--wait", action="store_true", help="until it ends (exit 1 if it failed)")
    s.add_argument("--timeout", type=float, default=7 * 24 * 3600)
    s.set_defaults(fn=cmd_status)
    for name in ("pause", "resume", "cancel"):
        s = actions.add_parser(name, help=f"{name} a study")
        s.add_argument("study", type=int)
        s.set_defaults(fn=cmd_control)
    s = actions.add_parser("apply", help="redeploy with the winner (or --variant ID)")
    s.add_argument("study", type=int)
    s.add_argument("--variant", type=int, default=None)
    s.add_argument("--level", default=None, help="apply the variant that wins at this level: a concurrency (16) or a "
                   "request rate (4/s)")
    s.add_argument("--persist", action="store_true", help="then install it as a systemd service")
    s.add_argument("--yes", action="store_true", help="confirm a winner that sets NCCL debugging variables")
    s.set_defaults(fn=cmd_apply)
    actions.add_parser("list", help="studies").set_defaults(fn=cmd_list)
