"""Django's ASGI HTTP handler, serving each request in one hop to a worker thread.

Why: the panel's views (DRF) and Django's stock middleware are synchronous. Under the stock
ASGIHandler every MiddlewareMixin hook, the request signals and the view each hop to a thread
(`sync_to_async`), about 14 hops per request, all on one shared thread per request context: a slow
request (the deployment events long poll waits up to 30 s) held up every other request of the
process. Here the request signals, middleware and view run together in one hop, on a pool of
`WEB_THREADS` threads, the way a threaded WSGI server runs Django; only reading the body and
sending the answer stay on the event loop. WebSockets stay on Channels' async consumers (asgi.py).
Each thread keeps its own database connection, recycled as under WSGI (request_started and
request_finished run in that thread: CONN_MAX_AGE, health checks).

A GET answered from the API cache for a caller with a token is answered on the event loop the next time it
comes alike, without the hop, the middleware or the view (plumbing/fastlane.py).

Unlike the stock handler, a client that disconnects does not cancel its request: a synchronous
view in a thread could not be stopped anyway.
"""
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.core import signals
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.conf import settings
from django.http import HttpResponse
from django.urls import set_script_prefix

from plumbing import credentials, fastlane


class BodyTooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(f"The request body is over {limit // 1024} KiB.")


class ThreadedASGIHandler(ASGIHandler):
    def __init__(self, threads: int):
        super().__init__()
        self.load_middleware(is_async=False)  # the synchronous chain, as under WSGI
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="http")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send):
        if await fastlane.serve(scope, send):  # a cached API answer, on this loop (plumbing/fastlane.py)
            return
        try:
            body_file = await self.read_capped_body(scope, receive)
        except RequestAborted:
            return
        except BodyTooLarge as exc:
            await self.send_response(HttpResponse(str(exc), status=413, content_type="text/plain"), send)
            return
        set_script_prefix(get_script_prefix(scope))
        try:
            response = await self._in_thread(self._serve, scope, body_file, time.perf_counter())
            if response.streaming and not response.is_async:
                # A file (static files): read it chunk by chunk in the pool; Django would read it
                # whole into memory first, warning about it on every request.
                response.streaming_content = self._chunks(iter(response.streaming_content))
            try:
                await self.send_response(response, send)
            finally:
                if response.streaming:  # its iterator (a file) was read while sending: close it now
                    await self._in_thread(response.close)
        finally:
            body_file.close()

    async def read_capped_body(self, scope, receive):
        """The body, refused (BodyTooLarge) past its cap before it reaches memory or disk: a declared
        Content-Length at once, a chunked body as soon as it passes the cap. The small pre-login cap
        holds until the request's credential (an API token or a session) is checked and found valid:
        any `Authorization` header or session cookie can be forged. The check runs once, only for a
        body past the small cap, so ordinary requests cost no lookup."""
        headers = dict(scope.get("headers") or [])
        limit, checked = settings.ANONYMOUS_BODY_MAX, False
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > limit:
            checked = True
            limit = await self._credential_limit(scope, headers)
            if declared > limit:
                raise BodyTooLarge(limit)
        body_file = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                body_file.close()
                raise RequestAborted()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit and not checked:
                checked = True
                limit = await self._credential_limit(scope, headers)
            if size > limit:
                body_file.close()
                raise BodyTooLarge(limit)
            body_file.write(chunk)
            if not message.get("more_body", False):
                break
        body_file.seek(0)
        return body_file

    async def _credential_limit(self, scope, headers) -> int:
        """REQUEST_BODY_MAX when the request carries a valid credential, else ANONYMOUS_BODY_MAX."""
        if b"authorization" not in headers and f"{settings.SESSION_COOKIE_NAME}=".encode() not in headers.get(b"cookie", b""):
            return settings.ANONYMOUS_BODY_MAX
        valid = await self._in_thread(credentials.valid, headers, (scope.get("client") or ("",))[0])
        return settings.REQUEST_BODY_MAX if valid else settings.ANONYMOUS_BODY_MAX

    async def _chunks(self, iterator):
        while (chunk := await self._in_thread(next, iterator, None)) is not None:
            yield chunk

    async def _in_thread(self, fn, *args):
        return await sync_to_async(fn, thread_sensitive=False, executor=self.executor)(*args)

    def _serve(self, scope, body_file, queued: float):
        """request_started, middleware and view, and (for a finished body) request_finished."""
        started = time.perf_counter()
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, response = self.create_request(scope, body_file)
        if request is not None:
            response = self.get_response(request)
            fastlane.learn(scope, request, response)
        if settings.SERVER_TIMING:
            cache = getattr(response, "cache_state", None)  # set by plumbing.apicache
            response["Server-Timing"] = ", ".join(
                [f"wait;dur={(started - queued) * 1000:.2f}", f"app;dur={(time.perf_counter() - started) * 1000:.2f}"]
                + ([f"cache;desc={cache}"] if cache else []))
        if not response.streaming:
            response.close()  # the body is in memory already; this sends request_finished
        return response
