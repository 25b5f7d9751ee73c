"""A deployment exported as one JSON document: the request that deploys it again (the body of POST /api/deployments/, its
flags and environment as resolved, the preset already in them), its gateway route, and every version with its outcome
and what changed. The page's export link, GET /api/deployments/<id>/export/ and `panelctl export-deployment` give it.

Secrets stay as the mask (deployments/secrets.py) and are named under "secrets": a deploy of the request refuses the
mask until each value is given."""
from django.utils import timezone

from deployments import secrets, versions
from deployments.gateway import selectors as gateway_selectors
from deployments.models import Deployment

FORMAT = "vllm-controlpanel/deployment-export/1"


def request_body(d: Deployment) -> dict:
    """What POST /api/deployments/ takes to deploy `d` again as it is set now (put a new name or node in it to copy)."""
    r = versions.resolved(d)
    return {"model": f"{r['model']}@{r['revision']}", "node": d.node.name, "name": d.name, "gpus": r["gpu_indices"],
            "port": r["port"], "preset": "none", "engine_args": r["engine_args"], "env": r["env"],
            "secret_env": r["secret_env"], "workers": [{"node": w["node"], "gpus": w["gpus"]} for w in r["workers"]],
            "master_port": d.master_port, "retry_advised": d.retry_advised,
            **{f: r[f] for f in versions.SETTINGS if f != "port"}, **gateway_selectors.route_of(d.pk)}


def export(d: Deployment) -> dict:
    """The whole document (see the module's text); its datetimes are for a JSON encoder that writes ISO 8601."""
    body = request_body(d)
    masked = [k for k, v in {**body["engine_args"], **body["env"]}.items() if v == secrets.MASK]
    return {"format": FORMAT, "exported": timezone.now(),
            "deployment": {"id": d.pk, "name": d.name, "node": d.node.name, "status": d.status,
                           "status_message": d.status_message, "created": d.created, "model_commit": d.model.commit,
                           "engine": d.node.engine_version or ""},
            "request": body, "secrets": masked, "versions": versions.listed(d)}
