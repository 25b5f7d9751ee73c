"""The command of an engine's container (deployments/host/containers.py): what subprocess.Popen does for an
engine on the process path, then exec the engine in place, so the container's main process *is* the engine.

    python -m deployments.host.containerexec --log LOG [--cwd DIR] [--uid N --gid N --groups A,B] -- ARGV...

In order, as Popen's child does it: stdin from /dev/null, stdout and stderr appended to LOG (opened here as
the container's root, 0600, like the agent opens it on the process path), the working folder, a session of
its own (the agent stops the engine by its session), the engine user's groups, group and user, no_new_privs
when ARGV does not start with setpriv --no-new-privs, then exec. Standard library only (osuser is).
"""
from __future__ import annotations

import argparse
import os
import sys

from deployments.host import osuser


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="containerexec")
    parser.add_argument("--log", required=True)
    parser.add_argument("--cwd", default="")
    parser.add_argument("--uid", type=int)
    parser.add_argument("--gid", type=int)
    parser.add_argument("--groups", default="")
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.argv[:1] == ["--"]:
        args.argv = args.argv[1:]
    if not args.argv:
        parser.error("no command to run")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    log = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    if args.cwd:
        os.chdir(args.cwd)
    try:
        os.setsid()
    except PermissionError:
        pass  # already a session leader (the runtime made it one)
    if args.uid is not None:
        os.setgroups([int(g) for g in args.groups.split(",") if g])
        os.setgid(args.gid if args.gid is not None else args.uid)
        os.setuid(args.uid)
    if "--no-new-privs" not in args.argv[:2]:
        osuser.no_new_privs()
    try:
        os.execvp(args.argv[0], args.argv)
    except OSError as exc:  # to the log, where the agent's follow reads why the engine never started
        print(f"cannot start {args.argv[0]}: {exc}", file=sys.stderr, flush=True)
        os._exit(127)


if __name__ == "__main__":
    main()
