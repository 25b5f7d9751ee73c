"""Multimodal URLs in a request: the engine fetches them from inside the GPU host, so only domains the
deployment's route allows pass (a way around the panel's own SSRF guard otherwise); `data:` URLs carry their
bytes and always pass. Any other scheme (file:, ftp:, …) is refused.

The rule is vLLM's own (`--allowed-media-domains`: the URL's host name, exactly one of the list), and the engine
gets the same list at launch (engine_args), so the gateway and the engine refuse the same URLs. vLLM reads an
empty list as "any domain": a route without domains gives the engine one that cannot resolve (NO_DOMAIN)."""
from urllib.parse import urlsplit

URL_KEYS = frozenset({"url", "image_url", "audio_url", "video_url", "file_url", "input_audio_url"})
SCANNED = ("messages", "input")  # chat messages; /v1/responses input (prompts of /v1/completions are text)
NO_DOMAIN = "none.invalid"  # RFC 6761's .invalid: never resolves
FLAG = "allowed-media-domains"


def urls(body: dict) -> list[str]:
    """Every string under a URL-ish key in the request's messages or input."""
    found: list[str] = []
    stack = [body.get(part) for part in SCANNED]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for name, value in node.items():
                if isinstance(value, str):
                    if name in URL_KEYS:
                        found.append(value)
                elif isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return found


def allowed(url: str, domains: tuple) -> bool:
    if url[:5].lower() == "data:":
        return True
    try:
        parts = urlsplit(url.strip())
        host = (parts.hostname or "").lower().rstrip(".")
    except ValueError:
        return False
    if parts.scheme.lower() not in ("http", "https") or not host:
        return False
    return host in domains


def refused(found: list[str], domains: tuple) -> str | None:
    """The first URL `domains` do not allow, or None."""
    return next((u for u in found if not allowed(u, domains)), None)


def engine_args(d, flags=None) -> dict:
    """The engine's --allowed-media-domains: its route's media domains as they are at launch; nothing for an
    engine whose flag list (`flags`, from `vllm serve --help=all`) lacks it (vLLM before 0.11)."""
    from deployments.gateway.models import Route

    if flags is not None and f"--{FLAG}" not in flags:
        return {}
    domains = Route.objects.filter(deployment_id=d.pk).values_list("media_domains", flat=True).first() or []
    return {FLAG: [str(m).lower().strip(".") for m in domains if m] or [NO_DOMAIN]}
