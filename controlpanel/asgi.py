"""ASGI entry point: Django for HTTP, Channels for WebSockets (authenticated, see routing.py)."""
import gc
import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")
django.setup(set_prefix=False)

from django.conf import settings  # noqa: E402

from plumbing import longpoll  # noqa: E402
from plumbing.handler import ThreadedASGIHandler  # noqa: E402

django_asgi_app = ThreadedASGIHandler(settings.WEB_THREADS)

from channels.auth import AuthMiddlewareStack  # noqa: E402  (needs Django set up first)
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from controlpanel.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
        "lifespan": longpoll.lifespan,  # a stop ends the long polls at once
    }
)

# Django's request objects form reference cycles (~40 objects a request), so under load the cycle
# collector ran a full pass over the heap every few hundred ms (70-110 ms each, measured with
# perf/api_latency.py): that was the p99 of every request. What is loaded by now lives as long as
# the process, so it is frozen out of the collector's scans, and the young generation is
# collected less often (WEB_GC_THRESHOLD; "700,10,10" restores Python's default).
gc.collect()
gc.freeze()
gc.set_threshold(*settings.WEB_GC_THRESHOLD)
