"""Sending Celery tasks from services, by name, once the current transaction commits.

Services name a task instead of importing their app's tasks module: tasks.py imports services, so
imports go one way. Each app's AppConfig.ready imports its tasks.py, so every process that runs
services has the tasks registered.

Engine control (issue 26: a Stop always happens) has a queue of its own on every node,
`node.<name>.control`, consumed by the node agent with threads of its own: a halt never waits behind
downloads, plans or benchmarks on `node.<name>`, and it never expires (a node that was away owes its
stops when it returns; deployments/node/redrive.py re-drives one that was lost).
"""
from celery import current_app
from django.db import transaction

# Short tasks that stop or forget engines: they go to the node's control queue and never expire.
CONTROL_TASKS = frozenset({
    "deployments.deployment_halt", "deployments.rank_halt", "deployments.deployment_rank_lost",
    "deployments.deployment_forget", "deployments.rank_forget",
})
NODE_PREFIX = "node."
CONTROL_SUFFIX = ".control"


def control_queue(node_queue: str) -> str:
    """The control queue next to a node's queue: `node.gpu-01` → `node.gpu-01.control`."""
    return node_queue + CONTROL_SUFFIX


def route(name: str, options: dict) -> dict:
    """The options a task is sent with: engine control sent to a node goes to its control queue, without expiry."""
    queue = options.get("queue") or ""
    if name in CONTROL_TASKS and queue.startswith(NODE_PREFIX) and not queue.endswith(CONTROL_SUFFIX):
        options = {k: v for k, v in options.items() if k != "expires"}
        options["queue"] = control_queue(queue)
    return options


def enqueue(name: str, *, args: list, **options) -> None:
    """apply_async of the registered task `name` with `options` (queue, countdown, expires) after commit;
    without a queue, the default one (control); engine control routed by `route`."""
    options = route(name, options)
    transaction.on_commit(lambda: current_app.tasks[name].apply_async(args=args, **options))


def send_now(name: str, *, args: list, **options) -> None:
    """The same, at once (no transaction to wait for): what a re-drive sends."""
    current_app.tasks[name].apply_async(args=args, **route(name, options))
