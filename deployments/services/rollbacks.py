"""Roll back: deploy a recorded version of a deployment exactly (deployments/versions.py), by default its known good one
(the last that reached ready, smoke-tested), through the usual redeploy with its plan and gates."""
from deployments import secrets, versions
from deployments.models import Deployment, DeployVersion, Node
from deployments.services import deploys, multinode
from plumbing.errors import ServiceError


def _version(d: Deployment, number: int | None) -> DeployVersion:
    if number is None:
        v = versions.known_good(d)
        if v is None:
            raise ServiceError(f"{d.name} has no known good version: none of its starts reached ready.",
                               code="no_known_good")
        return v
    v = DeployVersion.objects.filter(deployment=d, number=number).first()
    if v is None:
        raise ServiceError(f"{d.name} has no version {number}.", field="version", code="not_found")
    return v


def deployment_rollback(d: Deployment, number: int | None = None, user=None) -> Deployment:
    """Redeploy `d` with version `number` (None: its known good one) exactly as it was resolved."""
    v = _version(d, number)
    asked = v.request
    gone = [k for k, value in asked["env"].items() if value == secrets.MASK and k not in d.env]
    gone += [k for k, value in asked["engine_args"].items() if value == secrets.MASK and k not in d.engine_args]
    if gone:
        raise ServiceError(f"Version {v.number} set the secret {', '.join(gone)}, whose value is no longer stored (secrets "
                           "are kept once, for the current settings): set it again with a redeploy.", code="secret_gone")
    changes = {f: asked[f] for f in versions.SETTINGS if f in asked}
    if asked.get("workers"):
        nodes = {n.name: n for n in Node.objects.filter(name__in=[w["node"] for w in asked["workers"]])}
        missing = [w["node"] for w in asked["workers"] if w["node"] not in nodes]
        if missing:
            raise ServiceError(f"Version {v.number} ran on {', '.join(missing)}, which the panel no longer has.",
                               code="not_found")
        changes["workers"] = [multinode.Worker(nodes[w["node"]], w["gpus"]) for w in asked["workers"]]
    return deploys.deployment_redeploy(d, engine_args=asked["engine_args"], env=asked["env"],
                                       secret_env=asked["secret_env"], gpu_indices=asked["gpu_indices"], user=user,
                                       reason=f"rollback to version {v.number}", **changes)
