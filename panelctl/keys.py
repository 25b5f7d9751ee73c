"""panelctl keys: callers' keys for the node gateways (create: the secret printed once, on stdout alone, so
`KEY=$(panelctl keys create ci)` works; list; revoke by id, name or prefix).

    panelctl keys create ci-bot --model kimi --rps 5 --tpm 200000 --concurrency 4 --expires 30d
    panelctl keys list [--all]
    panelctl keys revoke ci-bot
"""
import re
from datetime import datetime, timedelta, timezone

from panelctl import client
from panelctl.client import BAD_INPUT, NOT_FOUND, CliError, emit, find_deployment, say

DURATION = re.compile(r"^(\d{1,5})([hd])$")


def expiry(text: str) -> str | None:
    """--expires 12h / 30d / an ISO date or time (UTC when no zone is given), as the API's ISO time."""
    if not text:
        return None
    match = DURATION.match(text.strip())
    if match:
        amount, unit = int(match.group(1)), match.group(2)
        return (datetime.now(timezone.utc) + timedelta(**{"hours" if unit == "h" else "days": amount})).isoformat()
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise CliError(f"--expires {text!r}: write 12h, 30d or a date such as 2027-01-31.", BAD_INPUT) from None
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).isoformat()


def _limits(k: dict) -> str:
    parts = [f"{k['rps_limit']:g}/s" if k["rps_limit"] else "", f"{k['tpm_limit']} tok/min" if k["tpm_limit"] else "",
             f"{k['max_concurrency']} at once" if k["max_concurrency"] else ""]
    return " ".join(p for p in parts if p) or "no limits"


def line(k: dict) -> str:
    scope = ", ".join(k["model_names"] + [f"deployment {d}" for d in k["deployments"]]) or "any model"
    state = "revoked" if k["revoked"] else f"expires {k['expires_at'][:16]}" if k["expires_at"] else "no expiry"
    used = k["usage"]
    return (f"{k['id']:>4} {k['prefix']}…  {k['name']:<20} {k['owner']:<12} {scope:<24} {_limits(k):<28} {state:<24} "
            f"last used {(k['last_used_at'] or 'never')[:16]:<16} {used['requests']} requests, {used['errors']} errors")


def cmd_create(panel, args):
    body = {"name": args.name, "model_names": args.model or [],
            "deployments": [find_deployment(panel, d)["id"] for d in args.deployment or []],
            "expires_at": expiry(args.expires), "rps_limit": args.rps, "tpm_limit": args.tpm,
            "max_concurrency": args.concurrency}
    key = panel.post("keys/", body, key=args.idempotency_key)
    say(f"Created key {key['name']} ({key['prefix']}…): {_limits(key)}. It is shown this once:")
    emit(key, args.json, [key["secret"]])
    return 0


def cmd_list(panel, args):
    params = {} if args.all else {"mine": "1"}
    found = panel.get("keys/", **params)["results"]
    emit(found, args.json, [line(k) for k in found] or ["No keys."])
    return 0


def _find(panel, ref: str) -> dict:
    if ref.isdigit():
        return panel.get(f"keys/{ref}/")
    mine = panel.get("keys/", mine="1")["results"]
    found = [k for k in mine if not k["revoked"] and (k["name"] == ref or (len(ref) >= 8 and k["prefix"].startswith(ref)))]
    if len(found) > 1:
        raise CliError(f"{len(found)} of your keys match {ref!r}: give its id (panelctl keys list).", BAD_INPUT)
    if not found:
        raise CliError(f"None of your live keys is named {ref!r} or starts with it (an admin revokes others' by id).",
                       NOT_FOUND)
    return found[0]


def cmd_revoke(panel, args):
    key = panel.post(f"keys/{_find(panel, args.key)['id']}/revoke/", key=args.idempotency_key)
    say(f"Revoked {key['name']} ({key['prefix']}…): every gateway refuses it within a second.")
    emit(key, args.json, [])
    return 0


def add(sub, common) -> None:
    """Register `panelctl keys ...` on panelctl's subcommands."""
    keys = sub.add_parser("keys", help="callers' keys for the node gateways: create, list, revoke")
    actions = client.with_common(keys.add_subparsers(dest="action", required=True), common)
    s = actions.add_parser("create", help="create a key; its secret is printed once, alone on stdout")
    s.add_argument("name", help="what it is for: a team, a script")
    s.add_argument("--model", action="append", metavar="NAME", help="a model name (served name or alias) it may "
                   "call, repeatable; none: any")
    s.add_argument("--deployment", action="append", metavar="DEPLOYMENT", help="a deployment (name or id) it may "
                   "call, repeatable; none: any")
    s.add_argument("--expires", default="", help="12h, 30d or a date (default: never)")
    s.add_argument("--rps", type=float, default=None, help="requests per second")
    s.add_argument("--tpm", type=int, default=None, help="tokens (prompt + output) per minute")
    s.add_argument("--concurrency", type=int, default=None, help="requests in flight at once")
    s.set_defaults(fn=cmd_create)
    s = actions.add_parser("list", help="your keys (--all: everyone's)")
    s.add_argument("--all", action="store_true")
    s.set_defaults(fn=cmd_list)
    s = actions.add_parser("revoke", help="revoke a key (id, or the name or prefix of one of yours)")
    s.add_argument("key")
    s.set_defaults(fn=cmd_revoke)
