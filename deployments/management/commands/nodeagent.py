"""The node agent: registers this host, heartbeats, samples it, runs a Celery worker on this host's
queues: `node.<name>` (downloads, benchmarks), `node.<name>.plans` (deploy plans, follows,
worker ranks' launches) and `node.<name>.control` (halts, never expiring), and the loop that re-drives
lost work from the database (deployments/node/redrive.py). Engine control and plans run on threads of
their own (plumbing/pool.py), so they never wait behind downloads and benchmarks.

    python manage.py nodeagent --name gpu-01 --model-store /models
"""
import socket
import threading

from celery import current_app
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections

from deployments.agent import Agent
from deployments.node import redrive
from plumbing import pool
from plumbing.queue import CONTROL, HOST, PLANS, control_queue, plan_queue

AGENT_VERSION = "0.1.0"


class Command(BaseCommand):
    help = "Run the node agent for this GPU host."

    def add_arguments(self, parser):
        parser.add_argument("--name", default=settings.NODE_NAME or socket.gethostname().split(".")[0].lower())
        parser.add_argument("--model-store", default=settings.MODEL_STORE)
        parser.add_argument("--address", default="", help="Address engines are reached at (default: this host's).")
        parser.add_argument("--sample-seconds", type=float, default=settings.SAMPLE_SECONDS)
        parser.add_argument("--heartbeat-seconds", type=float, default=settings.HEARTBEAT_SECONDS)
        parser.add_argument("--concurrency", type=int, default=4, help="Host tasks run at once (downloads, benchmarks).")
        parser.add_argument("--control-threads", type=int, default=pool.LANE_THREADS[CONTROL],
                            help="Threads kept for halts and forgets.")
        parser.add_argument("--plan-threads", type=int, default=pool.LANE_THREADS[PLANS],
                            help="Threads kept for deploy plans and follows (one per engine loading at once).")

    def handle(self, *args, name, model_store, address, sample_seconds, heartbeat_seconds, concurrency,
               control_threads, plan_threads, **options):
        from django.utils.text import slugify

        if slugify(name) != name:
            raise CommandError(f"node name {name!r} must be lowercase letters, digits and hyphens")
        for option, value in (("--concurrency", concurrency), ("--control-threads", control_threads),
                              ("--plan-threads", plan_threads)):
            if value < 1:
                raise CommandError(f"{option} must be at least 1, not {value}")
        settings.NODE_NAME = name
        agent = Agent(name=name, model_store=model_store, address=address or _own_address(),
                      version=AGENT_VERSION, sample_seconds=sample_seconds, heartbeat_seconds=heartbeat_seconds)
        from deployments.services.nodes import AgentConflict

        try:
            agent.register()
        except AgentConflict as exc:
            raise CommandError(str(exc)) from exc
        queue = f"node.{name}"
        self.stdout.write(f"node {name}: queues {queue}, {plan_queue(queue)} and {control_queue(queue)}, "
                          f"model store {model_store}, {agent.describe()}")
        stop = threading.Event()
        threading.Thread(target=agent.loop, args=(stop,), name="sampler", daemon=True).start()
        threading.Thread(target=agent.study_loop, args=(stop,), name="studies", daemon=True).start()
        pool.LANE_THREADS.update({CONTROL: control_threads, PLANS: plan_threads})
        redriver = redrive.Redriver(agent.node_id, queue=queue,
                                    slots={CONTROL: control_threads, PLANS: plan_threads, HOST: concurrency})
        threading.Thread(target=redriver.loop, args=(stop,), name="redrive", daemon=True).start()
        try:
            close_old_connections()
            # This node's queues only; other nodes' work never lands here. Every message is taken as it comes
            # (prefetch unlimited: the queues are this node's alone) and run on its lane's threads (the pool);
            # what waits, waits here, received, where the re-drive sees it in hand. One consumer: a second one in
            # this process took the agent down when Redis went away (before plumbing/broker.py's fix).
            # Without Celery's banner (--quiet, before the sub-command): `./panel start` prints the first admin's
            # password.
            # current_app: the project's Celery app (controlpanel/celery.py, made as the settings load; its Django
            # fix-up makes it the default of every thread), reached without importing the wiring.
            current_app.conf.worker_pool = "plumbing.pool:TaskPool"  # no --pool: the CLI takes only its aliases
            current_app.conf.worker_prefetch_multiplier = 0
            current_app.worker_main([
                "--quiet", "worker", "-Q", ",".join((control_queue(queue), plan_queue(queue), queue)),
                "-n", f"{name}@%h", "--concurrency", str(concurrency), "--loglevel", "INFO",
                "--without-gossip", "--without-mingle",
            ])
        finally:
            stop.set()


def _own_address() -> str:
    """The address other machines reach this host at (best effort, no traffic sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))
            return sock.getsockname()[0]
        except OSError:
            return "127.0.0.1"
