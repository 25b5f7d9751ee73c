"""Checking a caller's key in memory: who it is, whether it still holds, and what it may call.

Answers follow OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`), so the OpenAI clients
raise their usual AuthenticationError / PermissionDeniedError / NotFoundError. A refusal never echoes the key.
"""
import time

from deployments.gateway import peers
from deployments.gateway.config import PEER, Key, Snapshot, digest


class Refused(Exception):
    """A request the gateway answers itself: an HTTP status, an OpenAI error code and a message."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after, self.kind = status, code, message, retry_after, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.code}}


def bearer(header: str) -> str:
    scheme, _, token = (header or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def authenticate(snapshot: Snapshot, header: str, now: float | None = None, metrics: bool = False,
                 remote: str | None = None, peer: str | None = None, node: str = "") -> Key:
    """The key an `Authorization: Bearer …` header carries, or Refused(401); Refused(403) for a key that is not
    for this door: the scrape token opens engine metrics (`metrics`) and nothing else, and only it opens them.
    `peer` (the X-Panel-Node header) marks another node's gateway: its key is the one of that pair and hour
    (peers.py), taken from that node's address only (`remote`: the caller's) and for this `node` only."""
    secret = bearer(header)
    if not secret:
        raise Refused(401, "invalid_api_key", "Send your key as 'Authorization: Bearer <key>'.",
                      kind="authentication_error")
    if peer is not None:
        return _peer(snapshot, secret, peer, node, remote, metrics, now)
    key = snapshot.keys.get(digest(secret))
    if key is None:
        raise Refused(401, "invalid_api_key", "Incorrect API key provided.", kind="authentication_error")
    if key.revoked:
        raise Refused(401, "invalid_api_key", f"The key {key.prefix}… has been revoked.", kind="authentication_error")
    if key.expires_at is not None and key.expires_at <= (now if now is not None else time.time()):
        raise Refused(401, "invalid_api_key", f"The key {key.prefix}… has expired.", kind="authentication_error")
    if key.scrape != metrics:
        raise Refused(403, "forbidden", "Engine metrics are for the panel's scrape token only." if metrics else
                      "The scrape token opens engine metrics only: send a caller key.", kind="permission_error")
    return key


def _peer(snapshot: Snapshot, secret: str, peer: str, node: str, remote: str | None, metrics: bool,
          now: float | None) -> Key:
    if metrics:
        raise Refused(403, "forbidden", "Engine metrics are for the panel's scrape token only.",
                      kind="permission_error")
    address = snapshot.peers.get(peer)
    if address is None or (remote is not None and remote != address):
        raise Refused(403, "forbidden", "A gateway's key is taken from its own node's address only.",
                      kind="permission_error")
    if not peers.valid(secret, peer, node, now):
        raise Refused(401, "invalid_api_key", "Incorrect API key provided.", kind="authentication_error")
    return PEER


def may_call(key: Key, name: str) -> bool:
    return key.internal or not key.model_names or name in key.model_names


def may_use(key: Key, deployment_id: int) -> bool:
    return key.internal or not key.deployments or deployment_id in key.deployments


def names_for(snapshot: Snapshot, key: Key) -> list[str]:
    """The model names `key` may call now (GET /v1/models)."""
    return sorted(name for name, ids in snapshot.by_name.items()
                  if may_call(key, name) and any(may_use(key, i) for i in ids))


def scope_check(snapshot: Snapshot, key: Key, name: str) -> list[int]:
    """The deployments serving `name` that `key` may use; Refused(404) for a name nothing serves, (403) for one
    outside the key's scope."""
    ids = snapshot.by_name.get(name)
    if not ids:
        raise Refused(404, "model_not_found", f"The model '{name}' does not exist here.")
    if not may_call(key, name):
        raise Refused(403, "model_not_allowed", f"The key {key.prefix}… may not call '{name}'.",
                      kind="permission_error")
    allowed = [i for i in ids if may_use(key, i)]
    if not allowed:
        raise Refused(403, "model_not_allowed", f"The key {key.prefix}… may not call the deployments serving '{name}'.",
                      kind="permission_error")
    return allowed
