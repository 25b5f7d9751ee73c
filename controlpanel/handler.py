"""Django's ASGI HTTP handler, running each request's middleware and view in one worker thread.

Why: the panel's views (DRF) and Django's stock middleware are synchronous. Under the stock
ASGIHandler every MiddlewareMixin hook and the view each hop to a thread of their own
(`sync_to_async`), about 14 hops per request, all on one shared thread: a slow request (the
deployment events long poll waits up to 30 s) held up every other request in the process.
Here the whole synchronous chain runs in one hop, on a pool of `WEB_THREADS` threads, the way a
threaded WSGI server runs Django; WebSockets stay on Channels' async consumers (asgi.py).
Each thread keeps its own database connection, recycled as in WSGI (CONN_MAX_AGE, health checks).
"""
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.db import close_old_connections


class ThreadedASGIHandler(ASGIHandler):
    def __init__(self, threads: int):
        super().__init__()
        self.load_middleware(is_async=False)  # the synchronous chain, as under WSGI
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="http")

    async def __call__(self, scope, receive, send):
        # Django wraps each request in a ThreadSensitiveContext, which starts a fresh thread per
        # request for the few thread-sensitive calls left (the request signals, response.close);
        # those are cheap and may share asgiref's one process-wide thread instead.
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        await self.handle(scope, receive, send)

    async def get_response_async(self, request):
        return await sync_to_async(self._respond, thread_sensitive=False, executor=self.executor)(request)

    def _respond(self, request):
        close_old_connections()  # what request_started does under WSGI, in the thread that owns them
        try:
            return self.get_response(request)
        finally:
            close_old_connections()
