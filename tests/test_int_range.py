"""Integers a request carries beyond what a database column holds (2**63 - 1): SQLite raises
OverflowError where PostgreSQL answers, so each one must be refused before the database sees it —
400 naming the parameter for a filter, a page or a body field, 404 for an id in a path."""
import re
import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from drf_spectacular.generators import SchemaGenerator
from tests.helpers import api_client

pytestmark = pytest.mark.django_db
HUGE = str(2**64)
SCHEMA = SchemaGenerator().get_schema(request=None, public=True)["paths"]


@pytest.fixture
def objects(api_objects):
    return api_objects


def _page_patterns(resolver=None, prefix=""):
    """Every page route (not the API, the admin or the auth views) as a path template."""
    for entry in (resolver or get_resolver()).url_patterns:
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            if not route.startswith(("api/", "admin/", "accounts/")):
                yield from _page_patterns(entry, route)
        elif isinstance(entry, URLPattern):
            yield route


ID_PAGES = [route for route in _page_patterns() if "<id:" in route]
ID_OPERATIONS = [(method.upper(), path) for path, ops in SCHEMA.items() for method in ops
                 if "{id}" in path and method in ("get", "post", "delete")]
INT_QUERY = [(path, p["name"]) for path, ops in SCHEMA.items() if "{" not in path and "get" in ops
             for p in ops["get"].get("parameters", []) if p["in"] == "query" and p["schema"].get("type") == "integer"]
PAGINATION = {"limit", "offset"}


def test_the_cases_cover_the_routes_that_take_numbers():
    assert {"nodes/<id:pk>/", "deployments/<id:pk>/", "benchmarks/<id:pk>/"} <= set(ID_PAGES)
    assert ("GET", "/api/copies/{id}/") in ID_OPERATIONS and ("POST", "/api/deployments/{id}/stop/") in ID_OPERATIONS
    assert ("/api/copies/", "model") in INT_QUERY and ("/api/copies/", "limit") in INT_QUERY


@pytest.mark.parametrize("route", ID_PAGES)
def test_a_page_with_an_id_beyond_the_database_range_is_not_found(route, objects, operator_client):
    path = "/" + re.sub(r"<id:\w+>", HUGE, route)
    path = re.sub(r"<slug:\w+>", "stop", re.sub(r"<str:\w+>", "csv", path))
    assert operator_client.get(path).status_code == 404, path
    assert operator_client.post(path).status_code == 404, path


@pytest.mark.parametrize("method, path", ID_OPERATIONS)
def test_an_api_id_beyond_the_database_range_is_not_found(method, path, objects, operator):
    # A body and query that would be valid for an existing id, so only the id can be wrong.
    response = api_client(operator).generic(method, path.replace("{id}", HUGE) + "?node=n1", '{"node": "n1"}',
                                      content_type="application/json")
    assert response.status_code == 404, f"{method} {path}: {response.status_code} {response.content[:200]}"


@pytest.mark.parametrize("path, name", [case for case in INT_QUERY if case[1] not in PAGINATION])
def test_an_integer_filter_beyond_the_database_range_is_a_400_naming_it(path, name, objects, operator):
    response = api_client(operator).get(path, {name: HUGE})
    assert response.status_code == 400, f"{path}?{name}: {response.status_code} {response.content[:200]}"
    assert name in response.json()["error"]["fields"]


@pytest.mark.parametrize("path, name", [case for case in INT_QUERY if case[1] in PAGINATION])
def test_a_page_beyond_the_database_range_is_clamped_to_an_empty_page(path, name, objects, operator):
    response = api_client(operator).get(path, {name: HUGE})
    assert response.status_code == 200, f"{path}?{name}: {response.status_code} {response.content[:200]}"
    body = response.json()
    if name == "offset":  # past the end: an empty page
        assert body["results"] == [] and body["count"] >= 0
    else:  # a huge page: every row, on one page
        assert len(body["results"]) == body["count"] and body["next"] is None


@pytest.mark.parametrize("path, name", [("/api/runs/compare/", "ids"), ("/api/runs/export/", "ids")])
def test_a_list_of_ids_beyond_the_database_range_is_a_400_naming_it(path, name, objects, operator):
    response = api_client(operator).get(path, {name: f"1,{HUGE}"})
    assert response.status_code == 400 and name in response.json()["error"]["fields"]


def test_an_events_wait_beyond_the_range_is_a_400(objects, operator):
    response = api_client(operator).get(f"/api/deployments/{objects['deployments'].pk}/events/", {"wait": HUGE})
    assert response.status_code == 400 and "wait" in response.json()["error"]["fields"]


@pytest.mark.parametrize("path, body, field", [
    ("/api/deployments/", {"model": HUGE, "node": "n1"}, "model"),
    ("/api/deployments/", {"model": 1, "node": "n1", "replace": [HUGE]}, "replace"),
    ("/api/runs/", {"deployment": HUGE}, "deployment"),
])
def test_a_body_id_beyond_the_database_range_is_a_400_naming_it(path, body, field, objects, operator):
    body = {k: (int(v) if v == HUGE else v) for k, v in body.items()}
    body = {k: ([int(x) for x in v] if isinstance(v, list) else v) for k, v in body.items()}
    response = api_client(operator).post(path, body, format="json")
    assert response.status_code == 400, f"{path}: {response.status_code} {response.content[:300]}"
    assert field in response.json()["error"]["fields"]


@pytest.mark.parametrize("query", [f"runs={HUGE}", f"ids=1,{HUGE}"])
def test_the_compare_page_refuses_an_id_beyond_the_range(query, objects, operator_client):
    for path in ("/benchmarks/compare/", "/benchmarks/export.csv"):
        response = operator_client.get(f"{path}?{query}")
        assert response.status_code == 400, path
        assert query.split("=")[0].encode() in response.content, response.content[:200]


@pytest.mark.parametrize("path", ["/benchmarks/?deployment={huge}", "/models/{model}/deploy/?node={huge}",
                                  "/nodes/{node}/history.json?days=nan", "/nodes/{node}/history.json?since=nan"])
def test_a_page_filter_beyond_the_range_is_a_400(path, objects, operator_client):
    response = operator_client.get(path.format(huge=HUGE, model=objects["models"].pk, node=objects["nodes"].pk))
    assert response.status_code == 400, f"{path}: {response.status_code}"
