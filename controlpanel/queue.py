"""Sending Celery tasks from services, by name, once the current transaction commits.

Services name a task instead of importing their app's tasks module: tasks.py imports services, so
imports go one way. Each app's AppConfig.ready imports its tasks.py, so every process that runs
services has the tasks registered.
"""
from celery import current_app
from django.db import transaction


def enqueue(name: str, *, args: list, **options) -> None:
    """apply_async of the registered task `name` with `options` (queue, countdown, expires) after commit;
    without a queue, the default one (control)."""
    transaction.on_commit(lambda: current_app.tasks[name].apply_async(args=args, **options))
