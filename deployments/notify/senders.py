"""The only module that talks to mail servers and webhooks. Each sender takes a Message and the channel's
address (and key), returns the status code, or raises SendError saying whether a retry can help.

Webhooks (generic) get JSON signed with HMAC-SHA256 over "<timestamp>.<body>" with the channel's key:
    X-Panel-Timestamp: 1764700000
    X-Panel-Signature: sha256=<hex>
    X-Panel-Delivery: <delivery id>   (a retry after a lost answer repeats it: receivers dedupe on it)
Slack- and Matrix-compatible incoming webhooks get {"text": ...} ({"text", "html", "username"} for Matrix,
as matrix-hookshot's generic webhooks read it). Redirects are never followed (a redirect could send the
message somewhere nobody configured)."""
import hashlib
import hmac
import html
import json
import smtplib
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

from django.conf import settings
from django.core.mail import EmailMessage, get_connection

TIMEOUT_S = 10.0
SIGNATURE_HEADER = "X-Panel-Signature"
TIMESTAMP_HEADER = "X-Panel-Timestamp"
DELIVERY_HEADER = "X-Panel-Delivery"


class SendError(Exception):
    """A message not delivered; `permanent`: retrying cannot help (a 4xx, a refused address)."""

    def __init__(self, message: str, *, status_code: int | None = None, permanent: bool = False):
        super().__init__(message)
        self.status_code = status_code
        self.permanent = permanent


@dataclass(frozen=True)
class Message:
    """What a person reads, whatever the channel."""

    delivery: int
    event: str
    phase: str  # firing, resolved, test
    severity: str
    title: str
    text: str
    url: str = ""
    deployment: dict | None = None
    node: dict | None = None
    data: dict = field(default_factory=dict)

    @property
    def subject(self) -> str:
        prefix = {"firing": f"[{self.severity.upper()}]", "resolved": "[RESOLVED]", "test": "[TEST]"}[self.phase]
        return f"{prefix} {self.title}"

    def plain(self) -> str:
        return f"{self.subject}\n\n{self.text}" + (f"\n\n{self.url}" if self.url else "")


def sign(key: str, timestamp: str, body: bytes) -> str:
    """The X-Panel-Signature value of `body` sent at `timestamp` (receivers compute the same)."""
    return "sha256=" + hmac.new(key.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def send(kind: str, address: str, key: str, message: Message) -> int:
    """Send `message` to a channel of `kind` at `address`; the status code, or SendError."""
    if kind == "email":
        return _email(address, message)
    if kind == "webhook":
        body = json.dumps(asdict(message) | {"subject": message.subject}, separators=(",", ":")).encode()
        timestamp = str(int(time.time()))
        headers = {TIMESTAMP_HEADER: timestamp, DELIVERY_HEADER: str(message.delivery)}
        if key:
            headers[SIGNATURE_HEADER] = sign(key, timestamp, body)
        return _post(address, body, headers)
    if kind == "slack":
        return _post(address, json.dumps({"text": f"*{message.subject}*\n{message.text}"
                                          + (f"\n<{message.url}|Open in the panel>" if message.url else "")}).encode(), {})
    if kind == "matrix":
        rich = f"<b>{html.escape(message.subject)}</b><br>{html.escape(message.text)}"
        if message.url:
            rich += f'<br><a href="{html.escape(message.url)}">Open in the panel</a>'
        return _post(address, json.dumps({"text": message.plain(), "html": rich, "username": "vLLM panel"}).encode(), {})
    raise SendError(f"unknown channel kind {kind!r}", permanent=True)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, "redirects are not followed", headers, fp)


# urllib, not httpx: httpx logs every request's URL at INFO, and a Slack or Matrix hook's URL is its credential.
# The environment's proxy settings apply (webhooks usually live outside).
_OPENER = urllib.request.build_opener(_NoRedirect())


def _post(url: str, body: bytes, headers: dict) -> int:
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "vllm-panel", **headers})
    try:
        with _OPENER.open(request, timeout=TIMEOUT_S) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        code, text = exc.code, exc.read(200).decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SendError(f"cannot reach the webhook: {type(reason).__name__}: {reason}"[:300]) from exc
    # 408 and 429 say "later"; any other 4xx says the request is wrong (a deleted hook, a bad key); 3xx: not followed.
    permanent = 300 <= code < 500 and code not in (408, 425, 429)
    raise SendError(f"HTTP {code}: {text}", status_code=code, permanent=permanent)


def _email(address: str, message: Message) -> int:
    try:
        connection = get_connection(timeout=TIMEOUT_S)
        EmailMessage(message.subject, message.plain(), settings.DEFAULT_FROM_EMAIL, [address], connection=connection).send()
    except smtplib.SMTPRecipientsRefused as exc:
        codes = [c for c, _ in exc.recipients.values()]
        raise SendError(f"the mail server refused {address}", status_code=codes[0] if codes else None,
                        permanent=True) from exc
    except smtplib.SMTPResponseException as exc:
        raise SendError(f"SMTP {exc.smtp_code}: {exc.smtp_error!r}"[:300], status_code=exc.smtp_code,
                        permanent=500 <= exc.smtp_code < 600) from exc
    except (smtplib.SMTPException, OSError) as exc:
        raise SendError(f"{type(exc).__name__}: {exc}"[:300]) from exc
    return 250
