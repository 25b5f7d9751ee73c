"""panelctl: a deployment's versions (every deploy and redeploy, what changed, the known good one), a rollback, and
the deployment exported as a file (its deploy request, route and versions) and deployed again from one."""
import json
import sys

from panelctl import status
from panelctl.client import BAD_INPUT, CliError, done, emit, find_deployment, say


def cmd_versions(panel, args):
    d = find_deployment(panel, args.deployment)
    rows = panel.get(f"deployments/{d['id']}/versions/")["results"]
    if args.json:
        emit(rows, True, [])
        return 0
    for v in rows:
        outcome = f"ready in {v['ready_seconds']:.0f} s" if v["outcome"] == "ready" else v["outcome"]
        print(f"v{v['number']}  {v['created'][:16].replace('T', ' ')}  {v['reason']}: {outcome}"
              + ("  [known good]" if v["known_good"] else ""))
        if v["changes"]:
            print("    " + "; ".join(v["changes"]))
        if v["outcome"] == "failed" and v["outcome_message"]:
            print("    " + v["outcome_message"][:300])
    return 0


def cmd_rollback(panel, args):
    return status.deployment_action(
        panel, args, "rollback", want="ready", body={"version": args.version},
        saying=lambda d: f"Rolling {d['name']} back to " + (f"version {args.version}." if args.version else
                                                          "its known good version."))


def cmd_export(panel, args):
    d = find_deployment(panel, args.deployment)
    text = json.dumps(panel.get(f"deployments/{d['id']}/export/"), indent=2, ensure_ascii=False) + "\n"
    if args.output in ("", "-"):
        sys.stdout.write(text)
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(text)
        say(f"Wrote {d['name']} to {args.output}.")
    return 0


def cmd_import(panel, args):
    try:
        with open(args.file, encoding="utf-8") as f:
            body = json.load(f)["request"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"{args.file}: not a deployment export ({exc})", BAD_INPUT) from exc
    for item in args.env or []:  # secrets come as the mask: their values are given here
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(f"--env {item!r}: write NAME=VALUE", BAD_INPUT)
        body["env"][name] = value
    body.update({k: v for k, v in (("name", args.name), ("node", args.node)) if v})
    if args.node:  # another node: its own free port and the workers named again
        body.update(port=None, workers=[], master_port=None)
    body["replace_existing"] = args.replace
    d = panel.post("deployments/", body, key=args.idempotency_key)
    say(f"Deploying {d['name']} (id {d['id']}) from {args.file} on {d['node']}, port {d['port']}.")
    return status.wait_deployment(panel, d, args, want="ready") if args.wait else done(d, args)


def add(sub) -> None:
    """The `versions`, `rollback`, `export-deployment` and `import-deployment` subcommands."""
    s = sub.add_parser("versions", help="a deployment's versions: each deploy and redeploy, what changed, its outcome, "
                       "the known good one")
    s.add_argument("deployment")
    s.set_defaults(fn=cmd_versions)
    s = sub.add_parser("rollback", help="deploy a recorded version again exactly (default: the known good one, the last "
                       "that reached ready)")
    s.add_argument("deployment")
    s.add_argument("--version", type=int, default=None, help="the version number (panelctl versions NAME)")
    s.add_argument("--wait", action="store_true", help="wait until it serves, printing each step")
    s.add_argument("--timeout", type=float, default=7200)
    s.set_defaults(fn=cmd_rollback)
    s = sub.add_parser("export-deployment", help="a deployment as JSON: the deploy request that makes it again "
                       "(secrets masked), its gateway route and every version")
    s.add_argument("deployment")
    s.add_argument("-o", "--output", default="", help="a file (default: standard output)")
    s.set_defaults(fn=cmd_export)
    s = sub.add_parser("import-deployment", help="deploy from a file `panelctl export-deployment` wrote (give each "
                       "secret with --env)")
    s.add_argument("file")
    s.add_argument("--name", default="", help="a new name (default: the exported one)")
    s.add_argument("--node", default="", help="another node (its first free port; the exported worker nodes dropped)")
    s.add_argument("--env", action="append", default=[], help="NAME=VALUE: a secret's value, or any variable changed")
    s.add_argument("--replace", action="store_true", help="a deployment with this name exists: redeploy it")
    s.add_argument("--wait", action="store_true", help="wait until it serves, printing each step")
    s.add_argument("--timeout", type=float, default=7200)
    s.set_defaults(fn=cmd_import)
