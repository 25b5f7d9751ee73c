"""A real SMTP sink (aiosmtpd) and a real HTTP webhook receiver, a subscriber with one channel of each, and
`send_due()`: what the control worker's notify.deliver does for every due delivery, called as a function.
Task sends are caught before the broker (`sent_tasks`, tests/taskqueue.py)."""
from email import message_from_bytes

import pytest

from tests.conftest import free_port
from tests.webhooks import receiving


@pytest.fixture
def receiver():
    with receiving() as r:
        yield r


class Sink:
    def __init__(self):
        self.messages = []

    async def handle_DATA(self, server, session, envelope):
        self.messages.append((envelope.rcpt_tos, message_from_bytes(envelope.content)))
        return "250 OK"


@pytest.fixture
def smtp(settings):
    from aiosmtpd.controller import Controller

    sink = Sink()
    controller = Controller(sink, hostname="127.0.0.1", port=free_port())
    controller.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", controller.port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.EMAIL_HOST_USER = settings.EMAIL_HOST_PASSWORD = ""
    yield sink
    controller.stop()


@pytest.fixture
def send_due(sent_tasks):
    """Send every due delivery as the control worker would (notify.deliver as a function); the outcomes."""
    from deployments.notify import deliveries
    from deployments.notify.models import Delivery

    def run() -> list[str]:
        return [deliveries.delivery_send(pk) for pk in
                Delivery.objects.filter(status="pending").order_by("id").values_list("pk", flat=True)]
    return run


@pytest.fixture
def subscriber(db, receiver, monkeypatch):
    """An admin (webhook channels need one) with a signed webhook channel, subscribed to everything."""
    from deployments.notify import services
    from tests.factories import UserFactory

    monkeypatch.setenv("NOTIFY_RETRY_BASE_S", "0.2")
    user = UserFactory(role="admin", email="ops@example.com")
    channel, key = services.channel_add(user, "webhook", "ops hook", receiver.url)
    services.subscription_add(user, [])
    user.hook, user.key = channel, key
    return user
