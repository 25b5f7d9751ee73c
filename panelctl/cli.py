"""panelctl: the panel's REST API from scripts and terminals.

    export PANEL_URL=http://panel:8000 PANEL_TOKEN=...   (or: panelctl login --url ..., which asks for the token)
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
    panelctl tune start qwen3-0-6b-cpu-01 --vary max-num-seqs=8,16 --concurrency 16 --wait   # see panelctl/tune.py

Progress goes to stderr, results to stdout (--json for machines). Exit codes:
  0 done  1 the deploy/benchmark failed  2 bad input  3 conflict (busy, in use)
  4 not logged in or not allowed  5 not found  6 panel unreachable or server error  7 timed out
"""
import argparse
import getpass
import json
import os
import sys
from pathlib import Path

from panelctl import deployments, keys, models, nodes, recipes, runs, sleep, status, tune, versions, workloads
from panelctl.client import CliError, Panel, emit, find_deployment, say, with_common
from plumbing.privatefile import write_private

CONFIG = Path(os.environ.get("PANELCTL_CONFIG", Path.home() / ".config" / "panelctl.json"))


def cmd_login(panel, args):
    """The token from a prompt (a terminal) or standard input, not the command line, which every local user sees
    in `ps`; `--token` still works and says so."""
    token = args.token
    if token is not None and not args.token_stdin:
        print("panelctl: a token on the command line is visible to every local user (ps); prefer the prompt or "
              "--token-stdin", file=sys.stderr)
    elif args.token_stdin or not sys.stdin.isatty():
        token = sys.stdin.readline().strip()
    else:
        token = getpass.getpass("API token: ").strip()
    if not token:
        raise CliError("no token given (paste the one the account page shows)")
    Panel(args.url, token).get("nodes/")
    CONFIG.parent.mkdir(parents=True, exist_ok=True)
    write_private(CONFIG, json.dumps({"url": args.url, "token": token}))  # 0600 from its first byte
    say(f"Saved to {CONFIG}.")
    return 0


LISTS = {"nodes": nodes.cmd_nodes, "models": models.cmd_models, "deployments": deployments.cmd_deployments,
         "runs": runs.cmd_runs}


def cmd_list(panel, args):
    return LISTS[args.kind](panel, args)


def cmd_status(panel, args):
    """One object in full: a deployment or node by name, a model by repo id, a run by id."""
    if args.kind == "deployment":
        item = find_deployment(panel, args.ref)
        lines = status.deployment_lines(panel, item)
    elif args.kind == "node":
        item = panel.get(f"nodes/{args.ref}/")
        lines = [f"{item['name']}: {'online' if item['online'] else 'OFFLINE'}, {len(item['gpus'])} GPU(s), "
                 f"disk free {item['disk_free'] / 2**30:,.1f} GiB"]
    elif args.kind == "model":
        item = panel.get(f"models/{models.model_id(panel, args.ref)}/")
        lines = [f"{item['repo_id']}: {item['architecture'] or '?'}, {item['total_size'] / 2**30:,.1f} GiB"]
    else:
        item = panel.get(f"runs/{args.ref}/")
        lines = [f"Run {item['id']} {item['status']}: {item['name']}"]
    emit(item, args.json, lines)
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
    s.add_argument("--token", default=None, dest="token", help="the API token (visible in ps: prefer the prompt, "
                                                                 "or --token-stdin)")
    s.add_argument("--token-stdin", action="store_true", help="read the token from standard input")
    s.set_defaults(fn=cmd_login)
    nodes.add(sub)
    models.add(sub)
    deployments.add(sub)
    runs.add(sub)
    s = sub.add_parser("list", help="list nodes, models, deployments or runs (a table, or --json)")
    s.add_argument("kind", choices=["nodes", "models", "deployments", "runs"])
    s.set_defaults(fn=cmd_list)
    s = sub.add_parser("status", help="one deployment, node, model (repo id) or run (id) in full")
    s.add_argument("kind", choices=["deployment", "node", "model", "run"])
    s.add_argument("ref")
    s.set_defaults(fn=cmd_status)
    sleep.add(sub)
    versions.add(sub)
    tune.add(sub, common)
    recipes.add(sub, common)
    keys.add(sub, common)
    workloads.add(sub)
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
