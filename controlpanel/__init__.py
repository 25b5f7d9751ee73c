"""The wiring: settings, URLs, ASGI and WSGI, the Celery app, WebSocket routing, the /metrics view, middleware, the
context processor and template filters. It may import the apps (deployments, benchmarks) and plumbing; neither
imports it. Importing it makes the Celery app (below), so the apps' shared tasks and the queue find it."""
try:
    from .celery import app as celery_app
except ImportError:  # a bare GPU host running only tests/gpu has no Celery (nor Django)
    celery_app = None

__all__ = ["celery_app"]
