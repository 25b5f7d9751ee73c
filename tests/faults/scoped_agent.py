"""`manage.py nodeagent` for a test that needs a host of its own: on a node without GPUs the whole
host is one engine's claim, so every vLLM-looking process on it is "foreign", and on a shared
machine other sessions' engines are too (the checkbox would stop them). This agent sees only the
foreign processes started with FAULT_SCOPE=<its own FAULT_SCOPE> in their environment; what it
does with them (refuse, stop the group, spare display servers) is the real agent's code.

    python tests/faults/scoped_agent.py nodeagent --name ...   (run from the repository root)"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")

SCOPE = os.environ["FAULT_SCOPE"].encode()


def _in_scope(pid: int) -> bool:
    try:
        return b"FAULT_SCOPE=" + SCOPE in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def main() -> None:
    from django.core.management import execute_from_command_line

    from deployments.host import ownership

    every = ownership.engine_processes
    ownership.engine_processes = lambda: [pid for pid in every() if _in_scope(pid)]
    execute_from_command_line(["manage.py", *sys.argv[1:]])


if __name__ == "__main__":
    main()
