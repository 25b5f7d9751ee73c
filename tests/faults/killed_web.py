"""A web process that dies with SIGKILL right after its transaction commits, before `on_commit` sends
the task the request owed (tests/faults/test_lost_halts.py): the row says Stopping (or the run Queued)
and no message exists anywhere.

    python tests/faults/killed_web.py stop <deployment id>
    python tests/faults/killed_web.py bench <deployment id>      (run from the repository root)"""
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")


def main() -> None:
    import django

    django.setup()
    from django.db import transaction

    from benchmarks import services as runs
    from deployments.models import Deployment
    from deployments.services import deploys

    what, pk = sys.argv[1], int(sys.argv[2])
    d = Deployment.objects.get(pk=pk)
    with transaction.atomic():
        # on_commit callbacks run in the order they were registered: this one first, so the process dies
        # after the commit and before the service's own callback sends the task.
        transaction.on_commit(lambda: os.kill(os.getpid(), signal.SIGKILL))
        if what == "stop":
            deploys.deployment_stop(d)
        else:
            runs.run_create(deployment=d, params={"levels": [1], "min_requests": 2, "max_tokens": 8})
    sys.exit("the process outlived its commit")


if __name__ == "__main__":
    main()
