"""Benchmark tasks: load by ID, call the service."""
from celery import shared_task

from benchmarks import services


@shared_task(name="benchmarks.run_execute")
def run_execute(run_id: int) -> None:
    """Run a sweep (on the deployment's node, or on the control worker for a URL)."""
    services.run_execute(run_id)
