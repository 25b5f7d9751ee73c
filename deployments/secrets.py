"""Secrets in a deployment's settings are write-only: set once, never shown back to anyone.

A variable or flag whose name looks secret (a TOKEN, KEY, SECRET, PASSWORD ... part) is masked in
the API, the pages, unit text, benchmark environments, exports and log lines, and so is an env variable the
user marked secret (`Deployment.secret_env`, passed here as `marked`). A masked value sent
back unchanged (the edit form, an API client echoing what it read) keeps the stored value.

Text that comes from an engine's log (status and timeline messages, the log tail, live lines) goes
through `redact_deployment`: the deployment's own secret values, then anything that looks like a
credential whatever its source (a bearer token, an hf_/sk- key, a URL's password, NAME=value with a
secret-looking name), since an engine may print a secret the panel never knew (its own token, a proxy
password from the host's environment).
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


# A credential in free text, whatever set it. Each keeps what names the secret and masks the value.
_AUTH_RE = re.compile(r"(?i)(\b(?:proxy-)?authorization['\"]?\s*[:=]\s*['\"]?(?:(?:bearer|basic|token|digest)\s+)?)[^\s'\",;]+")
_BEARER_RE = re.compile(r"(?i)(\b(?:bearer|token)\s+)([A-Za-z0-9._~+/=-]{16,})")
# Hugging Face (user and org), the panel's own, OpenAI-style, Slack, GitHub and GitLab tokens.
_KNOWN_KEY_RE = re.compile(r"\b(?:hf_[A-Za-z0-9]{30,}|(?:api_org|pct|sk|xox[abprs]|gh[pousr]|glpat)[_-][A-Za-z0-9_-]{20,})")
_URL_PASSWORD_RE = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+@")
# NAME=value, NAME: value, 'NAME': 'value', "NAME": ["a", "b"], --name=value, --name value (vLLM logs its
# arguments as a dict, an env dump prints NAME=value): the value is masked when NAME looks secret.
_HEAD_RE = re.compile(r"""(?<![\w.-])(?:(?P<name>-{0,2}[A-Za-z_][\w.-]*)['"]?\s*[:=]\s*|(?P<flag>--[A-Za-z][\w-]*)\s+(?!-))""")
_VALUE_RE = re.compile(r"""\[(?P<list>[^\]\n]*)|\s*(?P<quote>['"])?(?P<value>(?(quote)[^'"\n]+|[^\s,;'"\]\)}]+))""")
_NOT_SECRET_VALUES = {"none", "null", "true", "false", MASK}


def _mask_assignments(text: str) -> str:
    out, pos = [], 0
    for head in _HEAD_RE.finditer(text):
        name = (head["name"] or head["flag"]).lstrip("-")
        if head.start() < pos or not is_secret_name(name):
            continue
        value = _VALUE_RE.match(text, head.end())
        group = "list" if value and value["list"] is not None else "value"
        if not value or not value[group].strip() or value[group].strip(" '\"").lower() in _NOT_SECRET_VALUES:
            continue
        out += [text[pos:value.start(group)], MASK]
        pos = value.end(group)
    return "".join(out) + text[pos:]


def scrub(text: str) -> str:
    """`text` with everything that looks like a credential masked (see the module's docstring)."""
    if not text:
        return text or ""
    text = _AUTH_RE.sub(lambda m: m[1] + MASK, text)
    text = _URL_PASSWORD_RE.sub(lambda m: m[1] + MASK + "@", text)
    text = _BEARER_RE.sub(lambda m: m[1] + MASK, text)
    text = _KNOWN_KEY_RE.sub(MASK, text)
    return _mask_assignments(text)


def redact_deployment(d, text: str) -> str:
    """Log, unit or message text of deployment `d` (None: of no deployment) without its secret values nor
    anything else that looks like a credential. Every message built from engine log lines goes through here."""
    values = secret_values(d.env, d.engine_args, marked=marked(d)) if d is not None else []
    return scrub(redact(text or "", values))


def redact_lines(d, lines: list[str]) -> list[str]:
    values = secret_values(d.env, d.engine_args, marked=marked(d))
    return [scrub(redact(line, values)) for line in lines]


def split(env: dict, marked: Iterable[str] = ()) -> tuple[dict, dict]:
    """(public, secret) parts of an environment, by name."""
    marked = set(marked)
    secret = {k: v for k, v in env.items() if is_secret(k, marked)}
    return {k: v for k, v in env.items() if k not in secret}, secret


def check_marked(names: Iterable[str], env: dict, engine_args: dict | None = None) -> str:
    """An error message when a name marked secret is not a variable of `env`, or a value of `env` or `engine_args` is
    the mask itself (copied from a page, the API or an export, which never show a secret); "" when all is well."""
    missing = [n for n in names if n not in (env or {})]
    if missing:
        return f"Marked secret but not in the environment: {', '.join(missing)}."
    masked = [k for k, v in {**(engine_args or {}), **(env or {})}.items() if v == MASK]
    return (f"{', '.join(masked)} holds {MASK}, how the panel shows a secret, not its value: give the value itself."
            if masked else "")
