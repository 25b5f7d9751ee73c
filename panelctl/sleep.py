"""panelctl: sleep mode — put a deployment to sleep, wake it, swap between two on the same GPUs, probe its sleep."""
import time

from panelctl import status
from panelctl.client import CliError, done, emit, find_deployment, say


def cmd_sleep(panel, args):
    return status.deployment_action(
        panel, args, "sleep", want="sleeping", since="sleep", body={"level": args.level},
        saying=lambda d: f"Putting {d['name']} to sleep"
        + (f" at level {args.level}." if args.level else " (level chosen by free RAM)."))


def cmd_wake(panel, args):
    return status.deployment_action(panel, args, "wake", want="ready", since="wake", saying=lambda d: f"Waking {d['name']}.")


def cmd_swap(panel, args):
    source, target = find_deployment(panel, args.source), find_deployment(panel, args.target)
    if source["id"] == target["id"]:
        raise CliError("Swap from one deployment to another.", 2)
    d = panel.post(f"deployments/{source['id']}/swap/", {"to": target["id"]}, key=args.idempotency_key)
    say(f"Swapping {source['name']} for {d['name']}: {source['name']} sleeps, {d['name']} "
        + ("wakes." if target["status"] == "sleeping" else "is deployed again."))
    if not args.wait:
        return done(d, args)
    return status.wait_deployment(panel, d, args, want="ready", since="swap" if target["status"] == "sleeping"
                                  else "queued")


def cmd_sleep_probe(panel, args):
    """Probe a ready sleep-mode deployment's sleep; with --wait, print the verdict and each level's figures (exit 1 when
    it failed)."""
    d = find_deployment(panel, args.deployment)
    last = (d.get("sleep_probe") or {}).get("id", 0)
    d = panel.post(f"deployments/{d['id']}/sleep-probe/", key=args.idempotency_key)
    say(f"Probing {d['name']}'s sleep: each level slept and woken, GPU memory and a fixed answer compared.")
    if not args.wait:
        return done(d, args)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        probe = panel.get(f"deployments/{d['id']}/").get("sleep_probe") or {}
        if probe.get("id", 0) > last and probe.get("verdict") != "running":
            if args.json:
                emit(probe, True, [])
            else:
                print(f"{probe['verdict']}: {probe['reason'] or 'every level tried passed'}")
                for r in probe["levels"]:
                    print(f"  level {r['level']}: " + (("passed" if r["passed"] else "failed")
                          + f", sleep {r['sleep_s']:.2f} s, wake {r['wake_s']:.2f} s, GPU before/asleep/after "
                          + "; ".join(f"{i}: {r['gpu_before'][i] / 2**30:.2f}/{b / 2**30:.2f}/"
                                      f"{r['gpu_after'].get(i, 0) / 2**30:.2f} GiB" for i, b in r["gpu_asleep"].items())
                          + f", answer {'same' if r['answer_same'] else 'changed'}" if r["tried"] else
                          f"not tried ({r['why']})"))
            return 0 if probe["verdict"] == "passed" else 1
        time.sleep(1)
    raise CliError(f"No verdict within {args.timeout:.0f} s: the probe may still run (see the deployment's timeline).", 1)


def add(sub) -> None:
    """The `sleep`, `wake` and `swap` subcommands (sub: with the common options)."""
    s = sub.add_parser("sleep", help="put a sleep-mode deployment to sleep (its GPUs free for another)")
    s.add_argument("deployment")
    s.add_argument("--level", type=int, choices=[1, 2], default=None, help="1: weights to host RAM; 2: dropped "
                   "(default: 1 when free RAM holds them)")
    s.add_argument("--wait", action="store_true", help="wait until asleep")
    s.add_argument("--timeout", type=float, default=600)
    s.set_defaults(fn=cmd_sleep)
    s = sub.add_parser("wake", help="wake a sleeping deployment")
    s.add_argument("deployment")
    s.add_argument("--wait", action="store_true", help="wait until serving")
    s.add_argument("--timeout", type=float, default=900)
    s.set_defaults(fn=cmd_wake)
    s = sub.add_parser("swap", help="swap the serving SOURCE for TARGET on the same GPUs: SOURCE sleeps, TARGET "
                       "wakes (or, stopped, is deployed again); the gateway's aliases follow")
    s.add_argument("source")
    s.add_argument("target")
    s.add_argument("--wait", action="store_true", help="wait until TARGET serves, printing each step's seconds")
    s.add_argument("--timeout", type=float, default=900)
    s.set_defaults(fn=cmd_swap)
    s = sub.add_parser("sleep-probe", help="prove a ready sleep-mode deployment's sleep: each level slept and woken, "
                       "GPU memory (NVML) and a fixed answer at temperature 0 compared; sleep and swaps use only what "
                       "it proved")
    s.add_argument("deployment")
    s.add_argument("--wait", action="store_true", help="wait for the verdict and print each level's figures")
    s.add_argument("--timeout", type=float, default=1800)
    s.set_defaults(fn=cmd_sleep_probe)


def deploy_arguments(s) -> None:
    s.add_argument("--sleep-mode", action="store_true", help="start with vLLM's sleep mode (CUDA GPUs, one node): it "
                   "can sleep, wake and share its GPUs with other sleep-mode deployments (panelctl swap)")
    s.add_argument("--start-asleep", action="store_true", help="with --sleep-mode: once loaded, put it to sleep "
                   "(ready to be swapped to)")


def deploy_body(args) -> dict:
    return {"sleep_mode": args.sleep_mode, "start_asleep": args.start_asleep}
