"""Benchmark tasks: load by ID, call the service."""
from celery import shared_task

from benchmarks import runqueue, services, workloads
from deployments import agenthooks


@shared_task(name="benchmarks.run_execute")
def run_execute(run_id: int) -> None:
    """Run a sweep (on the deployment's node, or on the control worker for a URL)."""
    services.run_execute(run_id)


@shared_task(name="benchmarks.workload_preview")
def workload_preview(workload_id: int) -> None:
    """A new workload's preview, off the web request (on the control worker)."""
    workloads.workload_preview(workload_id)


# The node agent re-sends queued runs whose task was lost (registered where the task is: every process
# that runs the agent loads this module through the app's ready()).
if runqueue.runs_redrive not in agenthooks.REDRIVERS:
    agenthooks.REDRIVERS.append(runqueue.runs_redrive)
