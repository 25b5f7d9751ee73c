"""Secrets in a deployment's settings are write-only: set once, never shown back to anyone.

A variable or flag whose name looks secret (a TOKEN, KEY, SECRET, PASSWORD ... part) is masked in
the API, the pages, unit text, benchmark environments, exports and log lines. A masked value sent
back unchanged (the edit form, an API client echoing what it read) keeps the stored value.
"""
import re
from collections.abc import Iterable

MASK = "••••••"
_SECRET_PARTS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "PASS", "CREDENTIAL", "CREDENTIALS", "AUTH",
                 "APIKEY", "PRIVATE", "COOKIE", "SIGNATURE", "CERT")
_SPLIT = re.compile(r"[_\-.]+")
_MIN_LEN = 4  # shorter values ("1", "on") are too common to redact from logs without mangling them


def is_secret_name(name: str) -> bool:
    """HF_TOKEN, VLLM_API_KEY, api-key, AWS_SECRET_ACCESS_KEY: yes; TOKENIZERS_PARALLELISM, NCCL_PROTO: no."""
    return any(part in _SECRET_PARTS or part.endswith(("TOKEN", "APIKEY", "PASSWORD", "SECRET"))
               for part in _SPLIT.split(str(name).upper()) if part)


def mask(values: dict) -> dict:
    """A copy of env or engine_args with every secret-named value replaced by MASK."""
    return {k: (MASK if is_secret_name(k) and v not in (None, "", True, False) else v) for k, v in (values or {}).items()}


def keep_masked(new: dict, old: dict) -> dict:
    """`new` with every value still equal to MASK replaced by the stored one (a masked value sent back)."""
    return {k: (old[k] if v == MASK and k in (old or {}) else v) for k, v in (new or {}).items()}


def secret_values(*settings: dict) -> list[str]:
    """The secret values among env / engine_args dicts, longest first (for redaction)."""
    found = {str(v) for d in settings for k, v in (d or {}).items()
             if is_secret_name(k) and isinstance(v, (str, int)) and not isinstance(v, bool) and len(str(v)) >= _MIN_LEN}
    return sorted(found, key=len, reverse=True)


def redact(text: str, values: Iterable[str]) -> str:
    """`text` with each of `values` replaced by MASK."""
    for value in values:
        text = text.replace(value, MASK)
    return text


def redact_deployment(d, text: str) -> str:
    """Log or unit text of deployment `d` without its secret values."""
    return redact(text or "", secret_values(d.env, d.engine_args))


def redact_lines(d, lines: list[str]) -> list[str]:
    values = secret_values(d.env, d.engine_args)
    return [redact(line, values) for line in lines] if values else lines


def split(env: dict) -> tuple[dict, dict]:
    """(public, secret) parts of an environment, by name."""
    secret = {k: v for k, v in env.items() if is_secret_name(k)}
    return {k: v for k, v in env.items() if k not in secret}, secret
