"""Sending Celery tasks from services, by name, once the current transaction commits.

Services name a task instead of importing their app's tasks module: tasks.py imports services, so
imports go one way. Each app's AppConfig.ready imports its tasks.py, so every process that runs
services has the tasks registered.

Engine work has queues of its own on every node (so a Stop always happens), consumed by the node
agent's worker with `node.<name>` (downloads, benchmarks):
- `node.<name>.control`: halts and forgets, short, never expiring (a node that was away owes its stops
  when it returns; deployments/node/redrive.py re-drives one that was lost or kept waiting for a thread).
- `node.<name>.plans`: plans, follows and worker ranks' launches; a plan keeps its expiry.
The agent's worker takes the three and runs each task on the threads of its `lane` (plumbing/pool.py),
so a halt or a plan never waits for a thread behind downloads and benchmarks.
"""
from celery import current_app
from django.db import transaction

# Short tasks that stop or forget engines: the node's control queue, never expiring.
CONTROL_TASKS = frozenset({
    "deployments.deployment_halt", "deployments.rank_halt", "deployments.deployment_rank_lost",
    "deployments.deployment_forget", "deployments.rank_forget",
})
# Tasks that launch and follow engines: the node's plans queue.
PLAN_TASKS = frozenset({
    "deployments.deployment_run", "deployments.deployment_follow", "deployments.rank_run",
    "deployments.deployment_persist",
})
NODE_PREFIX = "node."
CONTROL, PLANS, HOST = "control", "plans", "host"  # lanes: the threads a task runs on in the node agent


def lane(name: str) -> str:
    """Whose threads run task `name` in the node agent: engine control, engine plans, or host work."""
    return CONTROL if name in CONTROL_TASKS else PLANS if name in PLAN_TASKS else HOST


def control_queue(node_queue: str) -> str:
    """The control queue next to a node's queue: `node.gpu-01` → `node.gpu-01.control`."""
    return node_queue + ".control"


def plan_queue(node_queue: str) -> str:
    """The plans queue next to a node's queue: `node.gpu-01` → `node.gpu-01.plans`."""
    return node_queue + ".plans"


def route(name: str, options: dict) -> dict:
    """The options a task is sent with: engine work sent to a node's queue goes to the queue of its kind
    there (engine control without its expiry); anything else as given."""
    queue = options.get("queue") or ""
    if not queue.startswith(NODE_PREFIX) or queue.count(".") != 1:  # node names have no dots (slugs)
        return options
    if name in CONTROL_TASKS:
        return {**{k: v for k, v in options.items() if k != "expires"}, "queue": control_queue(queue)}
    if name in PLAN_TASKS:
        return {**options, "queue": plan_queue(queue)}
    return options


def deliver(name: str, args: list, options: dict) -> None:
    """Hand the registered task `name` to the broker now: the one place a task leaves the process (the
    tests record what reaches it, tests/taskqueue.py)."""
    current_app.tasks[name].apply_async(args=args, **options)


def enqueue(name: str, *, args: list, **options) -> None:
    """Deliver task `name` with `options` (queue, countdown, expires) after commit; without a queue, the
    default one (control); engine work routed by `route`."""
    options = route(name, options)
    transaction.on_commit(lambda: deliver(name, args, options))


def send_now(name: str, *, args: list, **options) -> None:
    """The same, at once (no transaction to wait for): what a re-drive sends."""
    deliver(name, args, route(name, options))
