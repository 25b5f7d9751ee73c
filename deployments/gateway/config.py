"""The snapshot a node gateway serves from: every caller key by digest and every active deployment as a target
(where to send, with which key, how many at once), loaded from the database in one go and swapped in whole.

Why a snapshot: a request must never wait on the database (keys are checked without a round trip),
and a swap of one object keeps a request from seeing half of a reload. deployments/gateway/server.py reloads it
when deployments/gateway/changes.py's version moves, or when the database's own stamps (stamps()) do.
"""
import gc
import hashlib
import logging
from dataclasses import dataclass, field
from typing import NamedTuple

from django.conf import settings
from django.db.models import Count, Max

from deployments import callit, sealed
from deployments.gateway.models import CallerKey, Route
from deployments.models import Deployment, Node

log = logging.getLogger(__name__)

# vLLM 0.32's --max-num-seqs defaults for its API server (vllm/engine/arg_utils.py
# get_batch_defaults): 1024 on GPUs of 70 GB or more (A100 excepted), else 256; 128 per rank on CPUs.
BIG_GPU_BYTES = 70 * 1024**3
SCRAPE_KEY_NAME = "prometheus"  # the internal key whose secret is the scrape token (deployments/scrapekey.py)
NONE = frozenset()


class Key(NamedTuple):
    """A caller key as the gateway checks it (no secret: the digest is the dict key). A tuple: 10,000 of them
    are built at every reload, and a tuple is built several times faster than a frozen dataclass."""

    id: int
    prefix: str
    model_names: frozenset
    deployments: frozenset  # deployment ids; empty: any
    expires_at: float | None  # epoch seconds
    revoked: bool
    internal: bool  # PEER: another node's gateway (peers.py)
    rps: float | None
    tpm: int | None
    concurrency: int | None
    scrape: bool = False  # Prometheus's scrape token (scrapekey.py): engine metrics, nothing else


PEER = Key(0, "gateway", frozenset(), frozenset(), None, False, True, None, None, None)  # what a peer gateway is


@dataclass(frozen=True)
class Target:
    """One active deployment: a local engine (its loopback port, its engine key) or a remote node's gateway."""

    id: int
    name: str  # the deployment's slug
    node: str  # its (head) node's name
    names: tuple  # model names callers may use: the served name, then the route's aliases
    served: str  # what the engine itself answers to: the body's "model" is rewritten to it
    url: str
    address: tuple  # (host, port) of `url`
    bearer: str  # the engine key (local); remote: "" (the peer key is made per request)
    local: bool
    ready: bool
    max_in_flight: int
    queue_bound: int
    media_domains: tuple


@dataclass
class Snapshot:
    keys: dict = field(default_factory=dict)  # digest -> Key
    targets: dict = field(default_factory=dict)  # deployment id -> Target
    by_name: dict = field(default_factory=dict)  # model name -> [deployment id] (active, ready or not)
    peers: dict = field(default_factory=dict)  # node name -> address: where each peer gateway's key may come from


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def default_in_flight(d: Deployment) -> int:
    """The engine's own --max-num-seqs, else vLLM's default for its hardware."""
    try:
        return max(1, int(d.engine_args.get("max-num-seqs")))
    except (TypeError, ValueError):
        pass
    gpus = list(d.gpus.all())
    if not gpus:
        return 128 * max(1, _int(d.engine_args.get("tensor-parallel-size")))
    if all(g.memory_total >= BIG_GPU_BYTES and "a100" not in g.name.lower() for g in gpus):
        return 1024
    return 256


def _int(value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 1


def _epoch(dt) -> float | None:
    return dt.timestamp() if dt is not None else None


def load_keys() -> dict:
    """Every key by digest. The cyclic garbage collector is paused meanwhile: 10,000 new tuples would trigger
    a dozen collections of everything the process holds (most of the time a reload took)."""
    gc.disable()
    try:
        return _load_keys()
    finally:
        gc.enable()


def _load_keys() -> dict:
    scopes: dict[int, set] = {}
    for key_id, deployment_id in CallerKey.deployments.through.objects.values_list("callerkey_id", "deployment_id"):
        scopes.setdefault(key_id, set()).add(deployment_id)
    keys = {}
    for row in CallerKey.objects.values_list("id", "prefix", "digest", "model_names", "expires_at", "revoked_at",
                                             "internal", "name", "rps_limit", "tpm_limit", "max_concurrency"):
        key_id, prefix, key_digest, names, expires, revoked, internal, name, rps, tpm, conc = row
        scrape = internal and name == SCRAPE_KEY_NAME
        if internal and not scrape:
            continue  # an earlier release's shared gateway key: peers now use peers.py's, one per node pair
        keys[key_digest] = Key(key_id, prefix, frozenset(n for n in names or () if isinstance(n, str)) if names else NONE,
                               frozenset(scopes[key_id]) if key_id in scopes else NONE, _epoch(expires),
                               revoked is not None, False, rps, tpm, conc, scrape)
    return keys


def revoked_since(stamp) -> tuple[list[str], object]:
    """Digests of the keys revoked after `stamp` (a revoked_at) and the newest revoked_at: the quick path that
    refuses a revoked key at once, before the whole reload (which takes a while with 10,000 keys)."""
    revoked = CallerKey.objects.filter(revoked_at__gt=stamp) if stamp else CallerKey.objects.exclude(revoked_at=None)
    rows = list(revoked.values_list("digest", "revoked_at"))
    newest = max((r[1] for r in rows), default=stamp)
    return [r[0] for r in rows], newest


def load_targets(node_name: str) -> dict:
    targets = {}
    scheme = "https" if settings.GATEWAY_TLS_CERT else "http"
    routes = {r.deployment_id: r for r in Route.objects.all()}
    for d in Deployment.objects.filter(status__in=Deployment.ACTIVE).select_related("node").prefetch_related("gpus"):
        served = callit.served_models(d)
        if not served:
            continue
        route = routes.get(d.pk)
        aliases = [n for n in (route.names if route else []) if isinstance(n, str) and n]
        local = d.node.name == node_name
        ready = d.status == Deployment.Status.READY
        if local:
            address = ("127.0.0.1", d.port)
            try:
                bearer = sealed.unseal(d.engine_key or "")
            except sealed.Unreadable as exc:
                log.error("Deployment %s is not routed to: its engine key cannot be read here (%s)", d.name, exc)
                bearer, ready = "", False
        else:
            if not d.node.address:
                continue
            address = (d.node.address, d.node.gateway_port or settings.GATEWAY_PORT)
            bearer = ""  # the peer key of the hour, made per request (peers.current)
        targets[d.pk] = Target(
            id=d.pk, name=d.name, node=d.node.name, names=tuple(dict.fromkeys([served[0], *aliases])), served=served[0],
            url=f"{'http' if local else scheme}://{address[0]}:{address[1]}", address=address,
            bearer=bearer, local=local, ready=ready,
            max_in_flight=(route.max_in_flight if route and route.max_in_flight else default_in_flight(d)),
            queue_bound=route.queue_bound if route else 256,
            media_domains=tuple(str(m).lower().strip(".") for m in (route.media_domains if route else []) if m))
    return targets


def load(node_name: str) -> Snapshot:
    """Everything the gateway of `node_name` serves from (two queries for keys, two for targets)."""
    targets = load_targets(node_name)
    by_name: dict[str, list[int]] = {}
    for target in targets.values():
        for name in target.names:
            by_name.setdefault(name, []).append(target.id)
    peers = dict(Node.objects.exclude(address="").exclude(name=node_name).values_list("name", "address"))
    return Snapshot(keys=load_keys(), targets=targets, by_name=by_name, peers=peers)


def stamps() -> tuple:
    """What changes in the database when a key is added, revoked or deleted, or a deployment moves, gets a new
    engine key or a route changes: polled when Redis cannot say (and for deployments always: a relaunch makes a
    new engine key without anyone calling changes.changed). Edits of a live key's scope or limits show only
    through changes.changed()."""
    keys = CallerKey.objects.aggregate(n=Count("id"), last=Max("id"), revoked=Max("revoked_at"))
    active = list(Deployment.objects.filter(status__in=Deployment.ACTIVE).order_by("id").values_list(
        "id", "status", "engine_key", "port", "node_id", "engine_args"))
    routes = list(Route.objects.order_by("id").values_list("deployment_id", "names", "max_in_flight", "queue_bound",
                                                           "media_domains"))
    nodes = list(Node.objects.order_by("id").values_list("id", "address", "gateway_port"))
    return (keys["n"], keys["last"], keys["revoked"]), repr((active, routes, nodes))
