"""A queued benchmark run is never lost: a lost `run_execute` (Redis restarted empty, a web
process killed before `on_commit`) left the run Queued forever and blocked every new run on its
deployment. The node agent's re-drive loop (deployments/node/redrive.py) calls `runs_redrive`, which
sends it again; `run_claim` lets exactly one copy run it."""
from benchmarks.models import BenchmarkRun

RUN_EXECUTE = "benchmarks.run_execute"
S = BenchmarkRun.Status


def run_claim(run: BenchmarkRun) -> bool:
    """Move a queued run to Running, unless another copy of its task (a re-drive) took it first."""
    if run.status != S.QUEUED or run.cancel_requested:
        return False
    run.transition(S.RUNNING)
    # A conditional update: two copies started at once both read Queued; one row update wins.
    if BenchmarkRun.objects.filter(pk=run.pk, status=S.QUEUED, cancel_requested=False).update(
            status=run.status, started=run.started):
        return True
    run.refresh_from_db()
    return False


def runs_redrive(node_id: int | None, due, send) -> int:
    """Send `run_execute` again for the runs Queued on this node's deployments (no node: the runs against a URL,
    which the control worker runs) that nothing ran for the re-drive's bound (`due`); how many were sent."""
    sent = 0
    queued = BenchmarkRun.objects.filter(status=S.QUEUED, cancel_requested=False)
    queued = queued.filter(deployment__node_id=node_id) if node_id else queued.filter(deployment=None).exclude(base_url="")
    for pk in queued.values_list("pk", flat=True):
        if due(RUN_EXECUTE, pk):
            sent += send(RUN_EXECUTE, pk, why="the run was queued and nothing ran it")
    return sent
