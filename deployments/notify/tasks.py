"""Notification tasks, on the control queue. Thin: each calls one function; the rows carry the retry state, so
a send's backoff is the row's `due` (deliveries.py), not a Celery retry that a restart would lose."""
from celery import shared_task

from deployments.notify import checks, deliveries


@shared_task(name="notify.deliver", ignore_result=True)
def deliver(delivery_id: int) -> str:
    """Send one delivery if it is due (a retry re-enqueues itself at its backoff)."""
    return deliveries.delivery_send(delivery_id)


@shared_task(name="notify.deliveries_due", ignore_result=True)
def deliveries_due() -> int:
    """Enqueue pending deliveries whose task was lost (a restart, a broker outage)."""
    return deliveries.deliveries_due()


@shared_task(name="notify.conditions_check", ignore_result=True)
def conditions_check() -> None:
    """Periodic conditions: nodes offline/back, disk, ECC, temperature; crash episodes that ended."""
    checks.conditions_check()
