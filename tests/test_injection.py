"""An injection corpus against every field users type: shell syntax, path traversal, huge values.

Each case gets a 400 naming its field; nothing is queued and no command ever runs (the canary
file that every payload tries to create never appears)."""

import pytest

from deployments.models import Deployment, ModelRepo
from tests.deployments.test_deploys import FLAGS
from tests.factories import GpuFactory, ModelCopyFactory, NodeFactory

pytestmark = pytest.mark.django_db
CANARY = "/tmp/panel-injection-canary"
PAYLOADS = [f"$(touch {CANARY})", f"`touch {CANARY}`", f"x; touch {CANARY}", f"x | touch {CANARY}",
            f"x && touch {CANARY}", f"x\ntouch {CANARY}", f"${{IFS}}touch${{IFS}}{CANARY}", f"x > {CANARY}"]


@pytest.fixture
def world(sent_tasks):
    node = NodeFactory(name="gpu-01", engine_flags=sorted(FLAGS))
    GpuFactory(node=node, index=0)
    model = ModelCopyFactory(node=node).model
    return node, model, sent_tasks


def _cases(model_id):
    deploy = {"model": model_id, "node": "gpu-01", "gpus": [0], "port": 8100}
    for p in PAYLOADS:
        yield "/api/models/", {"repo_id": f"org/m{p}"}, "repo_id"
        yield "/api/models/", {"repo_id": "org/m", "revision": p}, "revision"
        yield "/api/models/", {"node": "gpu-01", "local_path": f"/models/{p}"}, "local_path"
        yield "/api/deployments/", {**deploy, "engine_args": {"served-model-name": p}}, "engine_args"
        yield "/api/deployments/", {**deploy, "engine_args": {f"max-num-seqs{p}": 1}}, "engine_args"
        yield "/api/deployments/", {**deploy, "env": {"NCCL_PROTO": p}}, "env"
        yield "/api/deployments/", {**deploy, "env": {f"NCCL_{p}": "1"}}, "env"
        yield "/api/deployments/", {**deploy, "name": p}, "name"
        yield "/api/runs/", {"base_url": f"http://h/{p}", "levels": [1]}, "base_url"
        yield "/api/runs/", {"base_url": "http://10.0.0.1:8000", "served_model": p}, "served_model"
    traversal = ["../../etc/passwd", "/models/../../etc", "..", "org/../../x"]
    for t in traversal:
        yield "/api/models/", {"repo_id": t}, "repo_id"
        yield "/api/models/", {"node": "gpu-01", "local_path": t}, "local_path"
    yield "/api/models/", {"node": "gpu-01\x00", "local_path": "/models/x"}, "node"  # PostgreSQL refuses NUL
    yield "/api/deployments/", {**deploy, "node": "gpu\x00-01"}, "node"
    huge = "a" * 100_000
    yield "/api/models/", {"repo_id": f"org/{huge}"}, "repo_id"
    yield "/api/deployments/", {**deploy, "env": {"NCCL_PROTO": huge}}, "env"
    yield "/api/deployments/", {**deploy, "engine_args": {f"flag-{i}": i for i in range(1000)}}, "engine_args"
    yield "/api/deployments/", {**deploy, "port": 10**30}, "port"
    yield "/api/deployments/", {**deploy, "gpus": list(range(10_000))}, "gpus"
    yield "/api/runs/", {"base_url": "http://10.0.0.1:8000", "levels": [10**12]}, "levels"
    yield "/api/runs/", {"base_url": "http://10.0.0.1:8000", "max_tokens": -1}, "max_tokens"


def test_every_injection_case_is_refused_naming_its_field_and_nothing_runs(api, world):
    node, model, sent = world
    cases = list(_cases(model.pk))
    assert len(cases) > 80
    for path, body, field in cases:
        response = api.post(path, body, format="json")
        shown = str(body)[:120]
        assert response.status_code == 400, f"{path} {shown}: {response.status_code} {response.content[:200]}"
        assert field in response.json()["error"]["fields"], f"{path} {shown}: {response.json()}"
    for query in ("/api/models/?repo_id=org/a%00b", "/api/deployments/?name=x%00", "/api/copies/?node=%00"):
        assert api.get(query).status_code == 400, query
    assert not sent
    assert not Deployment.objects.exists() and not ModelRepo.objects.exclude(pk=model.pk).exists()
    import os

    assert not os.path.exists(CANARY)


def test_the_deploy_form_refuses_the_same_corpus(operator_client, world):
    node, model, sent = world
    for p in PAYLOADS:
        for field, value in (("extra_flags", f"--served-model-name {p!r}"), ("env", f"NCCL_PROTO={p}"),
                             ("reasoning_parser", p), ("name", p)):
            data = {"port": 8100, "tp": 1, "pp": 1, "dp": 1, "gpus": ["0"], "gpu_memory_utilization": 0.9,
                    "kv_cache_dtype": "auto", "stall_seconds": 600, field: value}
            response = operator_client.post(f"/models/{model.pk}/deploy/?node={node.pk}", data)
            assert response.status_code == 400, f"{field}={value!r}: {response.status_code}"
            assert field in response.context["form"].errors, f"{field}={value!r}: {response.context['form'].errors}"
    assert not sent
    assert not Deployment.objects.exists()
