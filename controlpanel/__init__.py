try:
    from .celery import app as celery_app
except ImportError:  # a bare GPU host running only tests/gpu has no Celery (nor Django)
    celery_app = None

__all__ = ["celery_app"]
