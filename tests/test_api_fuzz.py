"""Schemathesis against the panel's own OpenAPI schema: no input, however odd, gets a 5xx.

The real ASGI app serves the requests (uvicorn in a thread); tasks that calls would start are
caught before they reach the broker, so nothing runs on a host.
"""

import pytest
import schemathesis
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, Phase, settings

SCHEMA = schemathesis.openapi.from_dict(SchemaGenerator().get_schema(request=None, public=True))
pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def operator_token(live_server_asgi, operator):
    from plumbing import tokens
    from tests.factories import BenchmarkRunFactory, DeploymentFactory, GpuFactory, ModelCopyFactory, NodeFactory

    node = NodeFactory(name="n1")
    GpuFactory(node=node, index=0)
    ModelCopyFactory(node=node)
    BenchmarkRunFactory(deployment=DeploymentFactory(node=node, status="ready"))
    return tokens.issue(operator)


@pytest.fixture(autouse=True)
def no_broker(sent_tasks):
    return sent_tasks


@pytest.mark.slow
@SCHEMA.parametrize()
@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_api_fail_with_a_server_error(case, live_server_asgi, operator_token):
    """Twelve generated inputs for each of the API's operations, each against the real ASGI server (about a minute)."""
    response = case.call(base_url=live_server_asgi, headers={"Authorization": f"Token {operator_token}"}, timeout=30)
    assert response.status_code < 500, f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}"
