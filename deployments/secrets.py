"""Secrets in a deployment's settings are write-only: set once, never shown back to anyone.

A variable or flag whose name looks secret (a TOKEN, KEY, SECRET, PASSWORD ... part) is masked in
the API, the pages, unit text, benchmark environments, exports and log lines, and so is an env variable the
user marked secret (`Deployment.secret_env`, passed here as `marked`). A masked value sent
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


def is_secret(name: str, marked: Iterable[str] = ()) -> bool:
    """A secret-looking name, or one the user marked secret."""
    return is_secret_name(name) or name in marked


def marked(d) -> list[str]:
    """The env names deployment `d` has marked secret."""
    return list(getattr(d, "secret_env", None) or ())


def mask(values: dict, marked: Iterable[str] = ()) -> dict:
    """A copy of env or engine_args with every secret-named (or marked) value replaced by MASK."""
    marked = set(marked)
    return {k: (MASK if is_secret(k, marked) and v not in (None, "", True, False) else v) for k, v in (values or {}).items()}


def keep_masked(new: dict, old: dict) -> dict:
    """`new` with every value still equal to MASK replaced by the stored one (a masked value sent back)."""
    return {k: (old[k] if v == MASK and k in (old or {}) else v) for k, v in (new or {}).items()}


def secret_values(*settings: dict, marked: Iterable[str] = ()) -> list[str]:
    """The secret values among env / engine_args dicts, longest first (for redaction)."""
    marked = set(marked)
    found = {str(v) for d in settings for k, v in (d or {}).items()
             if is_secret(k, marked) and isinstance(v, (str, int)) and not isinstance(v, bool) and len(str(v)) >= _MIN_LEN}
    return sorted(found, key=len, reverse=True)


def redact(text: str, values: Iterable[str]) -> str:
    """`text` with each of `values` replaced by MASK."""
    for value in values:
        text = text.replace(value, MASK)
    return text


def redact_deployment(d, text: str) -> str:
    """Log or unit text of deployment `d` without its secret values."""
    return redact(text or "", secret_values(d.env, d.engine_args, marked=marked(d)))


def redact_lines(d, lines: list[str]) -> list[str]:
    values = secret_values(d.env, d.engine_args, marked=marked(d))
    return [redact(line, values) for line in lines] if values else lines


def split(env: dict, marked: Iterable[str] = ()) -> tuple[dict, dict]:
    """(public, secret) parts of an environment, by name."""
    marked = set(marked)
    secret = {k: v for k, v in env.items() if is_secret(k, marked)}
    return {k: v for k, v in env.items() if k not in secret}, secret


def check_marked(names: Iterable[str], env: dict) -> str:
    """An error message when a name marked secret is not a variable of `env`; "" when all are."""
    missing = [n for n in names if n not in (env or {})]
    return f"Marked secret but not in the environment: {', '.join(missing)}." if missing else ""
