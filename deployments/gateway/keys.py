"""Writes of the gateway's control plane: callers' keys (create, change scope, expiry and limits, revoke) and a
deployment's route (aliases, admission bounds, media domains). Each write tells every node gateway once it is
committed (changes.changed), so a revoked key is refused within a second everywhere.

Who may: operators manage their own keys, admins everyone's (key_manage_check); the panel's internal keys
(gateway to gateway, Prometheus) are never listed, changed or revoked here.
"""
import ipaddress
import re
import secrets
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from deployments.gateway import changes
from deployments.gateway.config import digest
from deployments.gateway.models import CallerKey, Route
from deployments.models import Deployment
from plumbing.errors import ServiceError
from plumbing.roles import is_admin, is_operator

SECRET_PREFIX = "vcp-"
PREFIX_LENGTH = 12  # "vcp-" and 8 random characters: enough to tell keys apart in a list, useless to a thief
# What a model name may be at the gateway (served names, aliases, a key's scope): OpenAI's and Hugging Face's
# names ("gpt-4o-mini", "org/model", "model:tag"), nothing a log line or a shell could misread.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")
DOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)*$")
MAX_NAMES = 50
MAX_RPS, MAX_TPM, MAX_CONCURRENCY = 1_000_000, 1_000_000_000, 100_000
MAX_IN_FLIGHT, MAX_QUEUE = 65_536, 100_000


def _tell(what: str) -> None:
    transaction.on_commit(lambda: changes.changed(what))


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def model_names_check(names, field: str = "model_names") -> list[str]:
    """A clean list of model names (order kept, duplicates dropped), or ServiceError naming the first bad one."""
    if names is None:
        return []
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise ServiceError("Give a list of model names.", field=field)
    out = []
    for name in names:
        text = name.strip() if isinstance(name, str) else name
        if not isinstance(text, str) or not MODEL_NAME.match(text):
            raise ServiceError(f"{str(name)[:60]!r} is not a model name: letters, digits and . _ : / - only, starting "
                               "with a letter or digit, at most 200 characters.", field=field)
        out.append(text)
    out = list(dict.fromkeys(out))
    if len(out) > MAX_NAMES:
        raise ServiceError(f"At most {MAX_NAMES} names.", field=field)
    return out


def _limit(value, field: str, kind, top):
    if value is None or value == "":
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ServiceError(f"{field}: a number, or empty for no limit (got {str(value)[:40]!r}).", field=field) from None
    if isinstance(value, bool) or not number > 0 or number > top or (kind is float and number != number):
        raise ServiceError(f"{field}: above 0 and at most {top:,} (or empty for no limit).", field=field)
    if kind is int and number != float(value):
        raise ServiceError(f"{field}: a whole number.", field=field)
    return number


def limits_check(rps=None, tpm=None, concurrency=None) -> dict:
    return {"rps_limit": _limit(rps, "rps_limit", float, MAX_RPS), "tpm_limit": _limit(tpm, "tpm_limit", int, MAX_TPM),
            "max_concurrency": _limit(concurrency, "max_concurrency", int, MAX_CONCURRENCY)}


def expiry_check(expires_at) -> datetime | None:
    if expires_at in (None, ""):
        return None
    if not isinstance(expires_at, datetime):
        raise ServiceError("expires_at: a date and time.", field="expires_at")
    if timezone.is_naive(expires_at):
        expires_at = timezone.make_aware(expires_at, timezone.utc)
    if expires_at <= timezone.now():
        raise ServiceError("expires_at is in the past: a key must be valid for a while.", field="expires_at")
    return expires_at


def deployments_check(ids) -> list[Deployment]:
    ids = list(dict.fromkeys(ids or []))
    found = {d.pk: d for d in Deployment.objects.filter(pk__in=[i for i in ids if isinstance(i, int)])}
    missing = [i for i in ids if i not in found]
    if missing:
        raise ServiceError(f"No deployment {missing[0]!r}.", field="deployments")
    return [found[i] for i in ids]


def key_manage_check(user, key: CallerKey) -> None:
    """Operators change their own keys, admins everyone's; internal keys nobody (here)."""
    if key.internal:
        raise ServiceError("This is one of the panel's own keys (gateways, Prometheus): it is managed by the panel.",
                           code="forbidden")
    if not (is_admin(user) or (is_operator(user) and key.owner_id == user.pk)):
        raise ServiceError("Only its owner or an admin may change this key.", code="forbidden")


def key_create(owner, name: str, model_names=None, deployments=None, expires_at=None, rps=None, tpm=None,
               concurrency=None) -> tuple[CallerKey, str]:
    """Create a caller key for `owner`; returns it and its secret, which is not kept (show it once)."""
    if not is_operator(owner):
        raise ServiceError("Creating keys needs the operator role.", code="forbidden")
    name = (name or "").strip()
    if not name or len(name) > 100 or any(ord(c) < 32 for c in name):
        raise ServiceError("Give the key a name (at most 100 characters), e.g. the team or script that uses it.",
                           field="name")
    if CallerKey.objects.filter(owner=owner, name=name, revoked_at__isnull=True, internal=False).exists():
        raise ServiceError(f"You have a key named {name!r} already: pick another name or revoke that one.",
                           field="name", code="exists")
    fields = {"model_names": model_names_check(model_names), "expires_at": expiry_check(expires_at),
              **limits_check(rps, tpm, concurrency)}
    scope = deployments_check(deployments)
    secret = new_secret()
    with transaction.atomic():
        key = CallerKey.objects.create(owner=owner, name=name, prefix=secret[:PREFIX_LENGTH], digest=digest(secret),
                                       **fields)
        key.deployments.set(scope)
        _tell("keys")
    return key, secret


UNSET = object()


def key_update(key: CallerKey, by, model_names=UNSET, deployments=UNSET, expires_at=UNSET, rps=UNSET, tpm=UNSET,
               concurrency=UNSET) -> CallerKey:
    """Change a key's scope, expiry or limits (only what is given); live at every gateway's next reload."""
    key_manage_check(by, key)
    if key.revoked_at is not None:
        raise ServiceError("This key is revoked: create a new one.", code="revoked")
    changes_ = {}
    if model_names is not UNSET:
        changes_["model_names"] = model_names_check(model_names)
    if expires_at is not UNSET:
        changes_["expires_at"] = expiry_check(expires_at)
    given = {"rps": rps, "tpm": tpm, "concurrency": concurrency}
    checked = limits_check(**{k: (None if v is UNSET else v) for k, v in given.items()})
    for (arg, value), field in zip(given.items(), ("rps_limit", "tpm_limit", "max_concurrency")):
        if value is not UNSET:
            changes_[field] = checked[field]
    scope = deployments_check(deployments) if deployments is not UNSET else None
    with transaction.atomic():
        for field, value in changes_.items():
            setattr(key, field, value)
        if changes_:
            key.save(update_fields=list(changes_))
        if scope is not None:
            key.deployments.set(scope)
        _tell("keys")
    return key


def key_revoke(key: CallerKey, by) -> CallerKey:
    """Revoke a key: every gateway refuses it within a second. Its usage stays."""
    key_manage_check(by, key)
    with transaction.atomic():
        updated = CallerKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())
        key.refresh_from_db()
        if not updated:
            raise ServiceError(f"The key {key.prefix}… was revoked already.", code="revoked")
        _tell("keys")
    return key


# Names that lead inside the GPU host's own network (RFC 6761 and 6762 special-use names, names that only resolve
# on a private network, cloud metadata services): the engine fetches media from there as the host.
INTERNAL_TLDS = frozenset({"localhost", "local", "localdomain", "internal", "intranet", "lan", "home", "corp",
                           "private", "arpa", "test", "invalid", "example", "onion"})


def internal_domain(name: str) -> str | None:
    """Why an engine must not fetch media from `name` unless an admin says so (an IP literal, a one-label name, a
    special-use or private name), or None."""
    try:
        ipaddress.ip_address(name)
        return "an IP address"
    except ValueError:
        pass
    if "." not in name:
        return "a name without a domain, resolved inside the host's network"
    if name.rsplit(".", 1)[1] in INTERNAL_TLDS:
        return "a special-use or private name, resolved inside the host's network"
    return None


def domains_check(domains, admin: bool = False, kept=()) -> list[str]:
    """Media domains checked: names, not addresses; internal ones (internal_domain) only an admin's, or kept as
    an admin set them (`kept`: the route's domains now)."""
    if domains is None:
        return []
    if isinstance(domains, str) or not isinstance(domains, (list, tuple)):
        raise ServiceError("Give a list of domains.", field="media_domains")
    out = []
    for domain in domains:
        text = domain.strip().lower().strip(".") if isinstance(domain, str) else ""
        why = internal_domain(text)
        if not DOMAIN.match(text) and why != "an IP address":
            raise ServiceError(f"{str(domain)[:60]!r} is not a domain name (e.g. images.example.com: the host of the "
                               "URL, exactly; a subdomain is an entry of its own).", field="media_domains")
        if why and not admin and text not in kept:
            raise ServiceError(f"Needs the admin role: {text} is {why}; the engine would fetch from inside the GPU "
                               "host.", field="media_domains", code="forbidden")
        out.append(text)
    return list(dict.fromkeys(out))


def _bound(value, field: str, top: int, low: int = 1):
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, str) and value.isdigit()):
        raise ServiceError(f"{field}: a whole number.", field=field)
    value = int(value)
    if not low <= value <= top:
        raise ServiceError(f"{field}: from {low} to {top:,}.", field=field)
    return value


def route_check(aliases=None, max_in_flight=None, queue_bound=None, media_domains=None, user=None,
                deployment=None) -> dict:
    """Route fields from a form, the API or panelctl: checked, or ServiceError for the first bad one. `user` and
    `deployment` (its route now): an internal media domain is an admin's to add (domains_check)."""
    queue = _bound(queue_bound, "queue_bound", MAX_QUEUE, low=0)
    kept = Route.objects.filter(deployment=deployment).values_list("media_domains", flat=True).first() if deployment else ()
    return {"names": model_names_check(aliases, field="aliases"),
            "max_in_flight": _bound(max_in_flight, "max_in_flight", MAX_IN_FLIGHT),
            "queue_bound": 256 if queue is None else queue,
            "media_domains": domains_check(media_domains, admin=bool(user and is_admin(user)), kept=kept or ())}


def names_check(user, names, exclude_ids=(), field: str = "aliases") -> None:
    """Served names and aliases belong to whoever deployed them: a name an active deployment of another user
    answers to at the gateway is refused (403), or callers of that name would be sent to this engine too. An
    admin may take any name; a stopped deployment holds none; `exclude_ids` (the deployment itself, those it
    replaces) are not in the way; rows with no creator (made by the panel's own commands) hold none."""
    wanted = {n for n in names or () if n}
    if user is None or is_admin(user) or not wanted:
        return
    others = list(Deployment.objects.filter(status__in=Deployment.ACTIVE).exclude(created_by=None)
                  .exclude(created_by=user).exclude(pk__in=[i for i in exclude_ids if i])
                  .values_list("pk", "name", "engine_args", "created_by__username"))
    aliases = dict(Route.objects.filter(deployment_id__in=[row[0] for row in others]).values_list("deployment_id", "names"))
    for pk, name, engine_args, owner in others:
        taken = wanted & {str((engine_args or {}).get("served-model-name") or ""), *map(str, aliases.get(pk) or ())}
        if taken:
            raise ServiceError(f"{sorted(taken)[0]!r} is a name of {name}, which {owner} deployed: a served name or "
                               "alias belongs to whoever deployed it. Choose another, or ask an admin.", field=field,
                               code="forbidden")


def route_set(deployment: Deployment, user=None, **fields) -> Route:
    """Set the deployment's route (the fields route_check returned); the gateways reload it. `user`'s aliases
    are checked against other users' names (names_check)."""
    names_check(user, fields.get("names"), [deployment.pk, *(deployment.replace or ())])
    with transaction.atomic():
        route, _ = Route.objects.update_or_create(deployment=deployment, defaults=fields)
        _tell("routes")
    return route

