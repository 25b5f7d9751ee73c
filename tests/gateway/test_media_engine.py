"""The engine's own media-domain check: it gets the route's domains at launch (--allowed-media-domains, vLLM's
exact host rule, which the gateway applies too), a name that cannot resolve when the route has none (vLLM reads
an empty list as any domain), and no user may set the flag."""
from unittest import mock

import pytest

from deployments import selectors
from deployments.gateway import media
from deployments.gateway.models import Route
from deployments.host import serveargv
from deployments.host.processes import EngineError
from deployments.models import Deployment
from tests.deployments.test_deploys import FLAGS
from tests.factories import DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory


@pytest.mark.django_db
def test_the_engine_gets_the_routes_media_domains_exactly_and_a_name_that_cannot_resolve_without_one():
    d = DeploymentFactory()
    assert media.engine_args(d) == {"allowed-media-domains": [media.NO_DOMAIN]}
    Route.objects.create(deployment=d, media_domains=["images.example.com", "cdn.example.org"])
    assert media.engine_args(d) == {"allowed-media-domains": ["images.example.com", "cdn.example.org"]}
    assert media.engine_args(d, flags={"--port"}) == {}  # an engine that does not know the flag (vLLM < 0.11)
    argv = serveargv.build_argv("vllm", "/m", 8100, "127.0.0.1", {"max-num-seqs": 8}, media.engine_args(d))
    assert argv[-5:] == ["--max-num-seqs", "8", "--allowed-media-domains", "images.example.com", "cdn.example.org"]
    ModelCopyFactory(model=d.model, node=d.node, path="/models/m")
    assert "--allowed-media-domains images.example.com cdn.example.org" in selectors.deployment_command(d)
    # The gateway's rule is the engine's: the host, exactly (a subdomain is an entry of its own).
    domains = ("images.example.com",)
    assert media.allowed("https://images.example.com/cat.png", domains)
    assert not media.allowed("https://cdn.images.example.com/cat.png", domains)
    assert not media.allowed("https://images.example.com.evil.org/x.png", domains)


def test_no_user_sets_the_flag_themselves():
    with pytest.raises(EngineError, match="set by the panel from the route's media domains"):
        serveargv.build_argv("vllm", "/m", 8100, "127.0.0.1", {"allowed-media-domains": ["169.254.169.254"]})
    errors = serveargv.validate_args({"allowed-media-domains": ["x"]}, {"--allowed-media-domains"})
    assert "set by the panel" in errors["allowed-media-domains"]


@pytest.mark.django_db(transaction=True)
def test_the_route_is_saved_before_the_plan_that_reads_it_is_sent(api, sent_tasks):
    """The plan reads the route's domains when it launches: a deploy sends it only once the route is committed."""
    node = NodeFactory(name="gpu-01", engine_flags=sorted(FLAGS))
    GpuFactory(node=node, index=0)
    model = ModelCopyFactory(node=node, path="/models/m").model
    seen = []

    def deliver(name, args, options):
        if name == "deployments.deployment_run":
            seen.append(list(Route.objects.filter(deployment_id=args[0]).values_list("media_domains", flat=True)))
        sent_tasks.record(name, args, options)

    with mock.patch("plumbing.queue.deliver", side_effect=deliver):
        response = api.post("/api/deployments/", {"model": model.pk, "node": "gpu-01", "gpus": [0], "preset": "none",
                                                  "media_domains": ["images.example.com"]}, format="json")
    assert response.status_code == 202, response.json()
    assert seen == [[["images.example.com"]]]
    assert Deployment.objects.count() == 1
