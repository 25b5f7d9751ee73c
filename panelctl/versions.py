"""panelctl: a deployment's versions (every deploy and redeploy, what changed, the known good one) and a rollback."""
from panelctl import status
from panelctl.client import emit, find_deployment


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


def add(sub) -> None:
    """The `versions` and `rollback` subcommands."""
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
