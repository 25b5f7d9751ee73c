"""`manage.py gateway --node NAME`: the node's gateway, the one public door to its engines."""
import asyncio
import logging
import signal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from plumbing.eventloops import new_loop, raise_fd_limit

log = logging.getLogger("deployments.gateway")


class Command(BaseCommand):
    help = "Run this node's OpenAI-compatible gateway: caller keys, limits, aliases, usage."

    def add_arguments(self, parser):
        parser.add_argument("--node", required=True, help="This node's name (its deployments are served locally).")
        parser.add_argument("--host", default="0.0.0.0", help="Address to listen on (default: every interface).")
        parser.add_argument("--port", type=int, default=settings.GATEWAY_PORT,
                            help=f"Port to listen on (default GATEWAY_PORT, {settings.GATEWAY_PORT}); 0 picks a free one.")
        parser.add_argument("--ready-wait", type=float, default=30.0,
                            help="Seconds a request waits for a ready deployment (swap, restart) before 503.")

    def handle(self, *args, node, host, port, ready_wait, **options):
        from deployments.gateway.server import Gateway, serve

        if not 0 <= port <= 65535:
            raise CommandError(f"--port must be 0-65535, not {port}")
        if ready_wait < 0:
            raise CommandError("--ready-wait must be 0 or more seconds")
        raise_fd_limit()
        loop = new_loop()
        asyncio.set_event_loop(loop)
        gateway = Gateway(node, ready_wait_s=ready_wait)
        try:
            runner = loop.run_until_complete(serve(gateway, host, port))
        except OSError as exc:
            raise CommandError(f"Cannot listen on {host}:{port}: {exc}") from exc
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # The line tests and `panel start` wait for; the port matters when --port 0 picked one.
        self.stdout.write(f"gateway of node {node} listening on http://{host}:{gateway.port}")
        self.stdout.flush()
        loop.run_until_complete(stop.wait())
        loop.run_until_complete(gateway.close())
        loop.run_until_complete(runner.cleanup())
        loop.close()

