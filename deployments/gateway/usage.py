"""Usage as the engines report it, counted in memory per (hour, key, model name, deployment) and added to the
`Usage` table every ~2 s.

Token counts are the engine's own `usage` fields, never a count of our own: prompt_tokens (input_tokens for
/v1/responses), completion_tokens (output_tokens) and, split out of them, reasoning tokens from
completion_tokens_details.reasoning_tokens (output_tokens_details for /v1/responses), which vLLM 0.32 fills
whenever the deployment runs a reasoning parser (vllm/entrypoints/openai/chat_completion/serving.py) and leaves
out otherwise: then every output token is content. Content = completion - reasoning.
"""
import datetime as dt
import logging
from dataclasses import dataclass

from django.db import close_old_connections, transaction
from django.db.models import F
from django.utils import timezone

from deployments.gateway.models import CallerKey, Usage
from deployments.models import Deployment

log = logging.getLogger(__name__)

UNKNOWN_MODEL = "(unknown)"  # a name nothing serves: counted, without making a row per name a caller invents


@dataclass
class Tokens:
    prompt: int = 0
    completion: int = 0
    reasoning: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def tokens_of(usage) -> Tokens | None:
    """The counts in an OpenAI `usage` object (chat, completions, embeddings or responses), None if it is not one."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens")) or 0
    details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    reasoning = details.get("reasoning_tokens") if isinstance(details, dict) else 0
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return Tokens(prompt, completion, reasoning if isinstance(reasoning, int) else 0)


CHARS_PER_TOKEN = 4  # English text in the usual BPE vocabularies: a prompt's tokens where the engine never said


def streamed(body: dict, events: int) -> Tokens:
    """What a stream that ended before its usage event (the caller cut it, the engine broke) is counted as: a
    token per event forwarded (vLLM sends one or more per event), and the prompt's text at CHARS_PER_TOKEN
    (media URLs not counted). Cutting a stream before its last event no longer makes it free."""
    text = sum(len(s) for s in _strings(body.get("messages", body.get("prompt", body.get("input")))))
    return Tokens(prompt=-(-text // CHARS_PER_TOKEN), completion=events)


def _strings(value):
    if isinstance(value, str):
        if not value.startswith("data:"):
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def from_event(obj) -> Tokens | None:
    """Usage in one streamed event: a chat/completions chunk's `usage`, or /v1/responses' response.completed."""
    if not isinstance(obj, dict):
        return None
    if obj.get("type") == "response.completed":
        return tokens_of((obj.get("response") or {}).get("usage"))
    return tokens_of(obj.get("usage"))


def hour_of(now: dt.datetime) -> dt.datetime:
    return now.replace(minute=0, second=0, microsecond=0)


class Meter:
    """Counters since the last flush; flush() runs in the gateway's database thread."""

    def __init__(self):
        self.counts: dict = {}  # (hour, key id, model name, deployment id) -> [requests, errors, prompt, reasoning,
        #                                                                    content, refused]
        self.used_keys: set = set()

    def count(self, key_id: int | None, name: str, deployment_id: int | None, error: bool,
              tokens: Tokens | None = None, refused: bool = False) -> None:
        """One request; `refused`: answered 429 (an error too), refused for load."""
        group = (hour_of(timezone.now()), key_id, name, deployment_id)
        row = self.counts.get(group)
        if row is None:
            row = self.counts[group] = [0] * 6
        row[0] += 1
        row[1] += 1 if error or refused else 0
        row[5] += 1 if refused else 0
        if tokens is not None:
            row[2] += tokens.prompt
            row[3] += tokens.reasoning
            row[4] += max(0, tokens.completion - tokens.reasoning)
        if key_id is not None:
            self.used_keys.add(key_id)

    def take(self) -> tuple[dict, set]:
        counts, used = self.counts, self.used_keys
        self.counts, self.used_keys = {}, set()
        return counts, used

    def put_back(self, counts: dict, used: set) -> None:
        """A flush that failed (database down): its counts join the next one."""
        for group, row in counts.items():
            mine = self.counts.setdefault(group, [0] * 6)
            for i, value in enumerate(row):
                mine[i] += value
        self.used_keys |= used


def flush(counts: dict, used: set) -> None:
    """Add `counts` to the Usage rows (update one row of the group, else create it) and stamp the keys' last use."""
    close_old_connections()
    keys = set(CallerKey.objects.filter(pk__in={g[1] for g in counts} - {None}).values_list("id", flat=True))
    deployments = set(Deployment.objects.filter(pk__in={g[3] for g in counts} - {None}).values_list("id", flat=True))
    with transaction.atomic():
        for (hour, key_id, name, deployment_id), (requests, errors, prompt, reasoning, content, refused) in counts.items():
            key_id = key_id if key_id in keys else None  # deleted since: its usage stays, unowned
            deployment_id = deployment_id if deployment_id in deployments else None
            rows = Usage.objects.filter(hour=hour, key_id=key_id, model_name=name[:200], deployment_id=deployment_id)
            first = rows.order_by("id").values_list("id", flat=True).first()
            if first is None:
                Usage.objects.create(hour=hour, key_id=key_id, model_name=name[:200], deployment_id=deployment_id,
                                     requests=requests, errors=errors, refused=refused, prompt_tokens=prompt,
                                     reasoning_tokens=reasoning, content_tokens=content)
            else:
                Usage.objects.filter(pk=first).update(
                    requests=F("requests") + requests, errors=F("errors") + errors, refused=F("refused") + refused,
                    prompt_tokens=F("prompt_tokens") + prompt, reasoning_tokens=F("reasoning_tokens") + reasoning,
                    content_tokens=F("content_tokens") + content)
        if used:
            CallerKey.objects.filter(pk__in=used & keys).update(last_used_at=timezone.now())
