"""The Celery app. Control-plane work goes to the `control` queue; every task that touches a
host is routed to that host's own queue `node.<name>` by the caller (see deployments.services), and
engine work to that node's `.control` and `.plans` queues (plumbing/queue.py)."""
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")

app = Celery("controlpanel")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
