"""The Celery app. Control-plane work goes to the `control` queue; every task that touches a
host is routed to that host's own queue `node.<name>` by the caller (see deployments.services), and
engine work to that node's `.control` and `.plans` queues (controlpanel/queue.py)."""
import os
import threading

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")

app = Celery("controlpanel")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def consumer_thread(queue: str, hostname: str, concurrency: int) -> threading.Thread:
    """Consume `queue` on `concurrency` threads of its own, in a thread of this process, next to the
    process's main worker: what runs there never waits for a thread the main worker's tasks hold.

    A Celery app selects the queues its workers consume app-wide (`app.amqp.queues`), so the second
    consumer gets an app of its own with the same configuration and tasks (shared tasks register on
    every app); both send through the default app, and a worker shutdown (state.should_stop) ends both."""
    own = Celery("controlpanel", set_as_current=False)
    own.config_from_object("django.conf:settings", namespace="CELERY")
    own.finalize(auto=True)
    # Without the event loop: its hub is process-wide (kombu.asynchronous.set_event_loop), and a second
    # consumer registering there lost its queue after a reconnect; a blocking drain needs none.
    worker = own.WorkController(hostname=hostname, queues=[queue], pool="threads", concurrency=concurrency,
                                use_eventloop=False, without_gossip=True, without_mingle=True, without_heartbeat=True,
                                loglevel="INFO")
    thread = threading.Thread(target=worker.start, name=f"worker-{queue}", daemon=True)
    thread.start()
    return thread
