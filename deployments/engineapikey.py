"""Control plane: each deployment's engine key, the engine's own API key, random and new at every
launch, stored sealed and known to the panel and its node gateways only.

Why: engines listen on loopback, and the node's gateway is the one public door; the key makes sure that
what reaches an engine's OpenAI routes is the panel (its gateway, smoke test, benchmarks, studies), not another
local user or a process the model's own code started. Callers never see it: they hold caller keys, checked by
the gateway, which then sends this one. vLLM reads it from VLLM_API_KEY (never the command line: every local
user can read /proc/<pid>/cmdline) and checks `Authorization: Bearer <key>` on /v1/*.

Stored sealed (deployments/sealed.py, like the Ray token), so a database dump alone does not open the engines.
"""
import secrets

from deployments import sealed
from deployments.models import Deployment

ENV_VAR = "VLLM_API_KEY"  # vllm/envs.py; a --api-key flag would win over it, and the panel refuses that flag


class KeyUnreadable(Exception):
    """The stored key cannot be opened on this host (its sealing key file is missing or another one)."""


def new(d: Deployment) -> str:
    """Make a new key for `d`'s next engine, store it sealed, and return it (the plan gives it to the engine)."""
    key = secrets.token_urlsafe(32)
    d.engine_key = sealed.seal(key)
    Deployment.objects.filter(pk=d.pk).update(engine_key=d.engine_key)
    return key


def of(d: Deployment) -> str:
    """The key `d`'s engine was started with, "" when it has none (started before engines had keys); KeyUnreadable when
    this host cannot open it."""
    try:
        return sealed.unseal(d.engine_key or "")
    except sealed.Unreadable as exc:
        raise KeyUnreadable(f"Cannot read the engine key of {d.name} here: {exc}") from exc


def current(d: Deployment) -> str:
    """of() for the row as stored now: a plan on another host may have made a new key since `d` was loaded."""
    stored = Deployment.objects.filter(pk=d.pk).values_list("engine_key", flat=True).first()
    if stored is not None:
        d.engine_key = stored
    return of(d)


def env(key: str) -> dict[str, str]:
    """The engine's variable carrying the key."""
    return {ENV_VAR: key} if key else {}
