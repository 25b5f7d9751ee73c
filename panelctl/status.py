"""panelctl: following a deployment's timeline until it is ready (or stopped, asleep), and one deployment in full."""
import json
import time

from panelctl.client import FAILED, TIMED_OUT, Panel, done, emit, find_deployment, say


def deployment_action(panel: Panel, args, action: str, want: str, since: str = "queued", body: dict | None = None,
                      saying=None) -> int:
    """POST deployments/<id>/<action>/ for the named deployment; say `saying(d)` (if given) and, with --wait,
    follow it until it is `want`."""
    d = find_deployment(panel, args.deployment)
    d = panel.post(f"deployments/{d['id']}/{action}/", body, key=args.idempotency_key)
    if saying:
        say(saying(d))
    return wait_deployment(panel, d, args, want=want, since=since) if args.wait else done(d, args)


def wait_deployment(panel: Panel, d: dict, args, want: str, since: str = "queued") -> int:
    """Follow the timeline until the deployment is `want` (ready: and smoke-tested); print each step once.
    Only what this request started is shown: the steps from the last `since` event on (the one the
    request added: "queued" for a deploy or restart, "stop" for a stop), never the deployment's history."""
    deadline = time.monotonic() + args.timeout
    state, floor, printed, last_line = "", None, set(), ""
    while time.monotonic() < deadline:
        answer = panel.get(f"deployments/{d['id']}/events/", state=state,
                           wait=min(20, max(1, int(deadline - time.monotonic()))))
        state = answer["state"]
        if floor is None:  # the first answer comes right after the request: its last `since` event is ours
            floor = max((e["id"] for e in answer["events"] if e["step"] == since), default=0)
        events = [e for e in answer["events"] if e["id"] >= floor]
        for event in events:
            if event["id"] not in printed and (event["ended"] or event["level"] != "info"):
                printed.add(event["id"])
                say(f"  {event['step']:<12} {event['message']}")
        line = f"  loading · {answer['load_phase'] or 'starting'} {answer['load_percent'] or 0:.0f} %"
        if answer["status"] == "loading" and line != last_line:
            say(line)
            last_line = line
        smoked = any(e["step"] == "smoke_test" and e["ended"] for e in events)
        if since in ("sleep", "wake", "swap") and (errors := [e for e in events if e["level"] == "error"]):
            say(f"{d['name']}: {errors[-1]['step']} not done: {errors[-1]['message']}")
            return FAILED
        if answer["status"] == want and (want != "ready" or since != "queued" or smoked):
            final = panel.get(f"deployments/{d['id']}/")
            emit(final, args.json, [f"{final['name']} is {want}"] + (call_lines(final) if want == "ready" else []))
            return 0
        if answer["status"] in ("failed", "stopped") and answer["status"] != want:
            say(f"{d['name']} {answer['status']}: {answer['status_message']}")
            if args.json:
                print(json.dumps(panel.get(f"deployments/{d['id']}/"), indent=2, default=str))
            return FAILED
    say(f"Timed out after {args.timeout:.0f} s waiting for {d['name']} to be {want}.")
    return TIMED_OUT


def call_lines(item: dict, snippets: bool = False) -> list[str]:
    """How to call a deployment: endpoint, model name(s), key; with `snippets`, curl and Python."""
    call = item.get("call") or {}
    lines = [f"  endpoint {call.get('base_url') or item['base_url'] + '/v1'}",
             f"  model    {', '.join(call.get('models') or []) or 'unknown (no copy on the node yet)'}",
             "  API key  " + ("needed: a caller key of the node's gateway (`panelctl keys create`; the snippets read "
                              "$OPENAI_API_KEY)" if call.get("key_required") else "none needed")]
    if snippets and call.get("curl"):
        lines += ["  curl:", *("    " + line for line in call["curl"].splitlines()),
                  "  python (openai):", *("    " + line for line in call["python"].splitlines())]
    return lines


def deployment_lines(panel: Panel, item: dict) -> list[str]:
    """`panelctl status deployment`: state, how to call it, the last error, where it runs, its flags, snippets."""
    errors = [e for e in panel.get(f"deployments/{item['id']}/events/")["events"] if e["level"] == "error"]
    error = (f"{errors[-1]['message']} ({errors[-1]['step']}, {errors[-1]['started']})" if errors
             else item["status_message"] if item["status"] == "failed" else "none")
    return [f"{item['name']}: {item['status']}" + (f" — {item['status_message']}" if item["status_message"] else ""),
            *call_lines(item), f"  last error {error}",
            f"  node {item['node']}, port {item['port']}, GPUs {item['gpus'] or 'none (CPU)'}",
            f"  flags {' '.join(f'--{k}' if v is True else f'--{k} {v}' for k, v in item['engine_args'].items())}",
            *call_lines(item, snippets=True)[3:]]
