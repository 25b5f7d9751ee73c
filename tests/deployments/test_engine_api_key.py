"""Engine keys, node side and panel side with the engine replaced at its boundary: every engine the panel starts
listens on loopback with a key of its own, new at every launch, sealed at rest and handed over in VLLM_API_KEY (never
argv); the smoke test and the benchmark runner send it; a user's own --api-key is refused everywhere; Prometheus'
scrape key for the gateways follows the scrape token. The real engine (its sockets, its 401) is
tests/e2e/test_security_bench_memory.py."""
from unittest import mock

import pytest
from django.test import override_settings

from benchmarks import services as bench_services
from deployments import engineapikey, privileged, scrapekey, sealed
from deployments.gateway.models import CallerKey
from deployments.host import serveargv
from deployments.host.processes import EngineError
from deployments.models import Deployment
from deployments.node import plan
from plumbing.errors import ServiceError
from tests.deployments.test_deploys import FLAGS, host, model, node  # noqa: F401 - fixtures
from tests.factories import BenchmarkRunFactory, DeploymentFactory, UserFactory

pytestmark = pytest.mark.django_db
S = Deployment.Status


def _run(model, node, host):
    d = DeploymentFactory(model=model, node=node, port=8000, status=S.QUEUED,
                          engine_args={"served-model-name": "tiny", "tensor-parallel-size": 2})
    d.gpus.set(node.gpus.filter(index__in=[0, 1]))
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.READY, d.status_message
    return d


def test_each_launch_gets_a_new_sealed_key_in_its_environment_never_argv_and_listens_on_loopback(model, node, host):
    d = _run(model, node, host)
    argv, env = host.spec.argv, host.spec.env
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    key = engineapikey.of(d)
    assert len(key) >= 40 and sealed.is_sealed(d.engine_key) and key not in d.engine_key
    assert env["VLLM_API_KEY"] == key and key not in " ".join(argv) and "--api-key" not in argv
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"  # its processes talk over loopback too
    smoke = host.mocks["vllm.smoke_test"].call_args
    assert smoke.kwargs["key"] == key  # the panel's own smoke test sends it
    Deployment.objects.filter(pk=d.pk).update(status=S.QUEUED)  # a redeploy: a new plan, a new key
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.READY and engineapikey.of(d) != key and host.spec.env["VLLM_API_KEY"] == engineapikey.of(d)


def test_a_deployment_variable_cannot_replace_the_key(model, node, host):
    d = DeploymentFactory(model=model, node=node, port=8000, status=S.QUEUED, env={"VLLM_API_KEY": "mine"},
                          engine_args={"served-model-name": "tiny"})  # stored before the refusal existed
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert host.spec.env["VLLM_API_KEY"] == engineapikey.of(d) != "mine"


def test_a_stored_api_key_flag_fails_the_launch_saying_why(model, node, host):
    d = DeploymentFactory(model=model, node=node, port=8000, status=S.QUEUED,
                          engine_args={"served-model-name": "tiny", "api-key": "sk-old-1234"})
    plan.deployment_run(d.pk)
    d.refresh_from_db()
    assert d.status == S.FAILED and "The engine's key (--api-key, VLLM_API_KEY) is set by the panel" in d.status_message
    assert "panelctl keys create" in d.status_message and "sk-old-1234" not in d.status_message
    with pytest.raises(EngineError, match=r"\(--api-key, VLLM_API_KEY\) is set by the panel"):
        serveargv.build_argv("vllm", "/m", 8000, serveargv.API_HOST, {"api-key": "k"})


@pytest.mark.parametrize("args, env, field", [({"api-key": "k1234"}, {}, "extra_flags"),
                                              ({}, {"VLLM_API_KEY": "k1234"}, "env")])
def test_privileged_refuses_the_engines_key_from_everyone(args, env, field):
    """The service-level check (every deploy, redeploy and study variant passes it), for admins too."""
    with pytest.raises(ServiceError, match="set by the panel") as exc:
        privileged.check(engine_args=args, env=env, model_dir="/m", admin=True)
    assert exc.value.field == field and "k1234" not in exc.value.message


def test_a_benchmark_of_a_deployment_sends_its_engines_key(model, node, host):
    d = _run(model, node, host)
    run = BenchmarkRunFactory(deployment=d, served_model="", params={"levels": [1]}, status="queued")
    seen = {}

    def sweep(spec, **kwargs):
        seen["spec"] = spec
        raise bench_services.runner.RunnerError("stop here", permanent=True)

    with mock.patch("benchmarks.runqueue.run_claim", autospec=True, return_value=True), \
         mock.patch("benchmarks.services.runner.sweep_in_child", side_effect=sweep):
        bench_services.run_execute(run.pk)
    assert host.mocks["vllm.served_models"].call_args.kwargs["key"] == engineapikey.of(d)  # model-name discovery
    assert seen["spec"].api_key == engineapikey.of(d) and seen["spec"].base_url == f"http://127.0.0.1:{d.port}"


def test_the_scrape_key_follows_the_scrape_token():
    UserFactory(role="admin")
    with override_settings(METRICS_TOKEN="scrape-one"):
        first = scrapekey.ensure()
        assert first.internal and first.digest == scrapekey.digest("scrape-one") and first.revoked_at is None
        assert "scrape-one" not in first.prefix
        assert scrapekey.ensure().pk == first.pk  # nothing new while the token stays
    with override_settings(METRICS_TOKEN="scrape-two"):
        second = scrapekey.ensure()
    assert second.pk != first.pk and CallerKey.objects.get(pk=first.pk).revoked_at is not None
    with override_settings(METRICS_TOKEN=""):
        assert scrapekey.ensure() is None
    assert not CallerKey.objects.filter(internal=True, revoked_at=None).exists()
    with override_settings(METRICS_TOKEN="scrape-one"):  # an old token back: its key again, not a second row
        assert scrapekey.ensure().pk == first.pk and CallerKey.objects.filter(internal=True, revoked_at=None).count() == 1


def test_the_service_discovery_view_keeps_the_scrape_key(client):
    UserFactory(role="admin")
    with override_settings(METRICS_TOKEN="scrape-three"):
        assert client.get("/api/prometheus/targets/", HTTP_AUTHORIZATION="Bearer scrape-three").status_code == 200
    assert CallerKey.objects.get(internal=True, revoked_at=None).digest == scrapekey.digest("scrape-three")
