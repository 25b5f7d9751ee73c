"""/api/keys/ and /api/usage/: the secret in the create answer and nowhere after, the roles (viewers read,
operators change their own, admins everyone's), usage summed by hour or day per key, model or deployment,
and CSV that a spreadsheet opens as data; the deploy API's route fields."""
import csv
import io
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from unittest import mock

import pytest

from deployments.gateway import keys, selectors
from deployments.gateway.models import CallerKey, Route, Usage
from deployments.models import DeploymentEnergy
from tests.factories import DeploymentFactory, UserFactory
from tests.helpers import api_client

pytestmark = pytest.mark.django_db
HOUR = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
# The usage queries' clock: past noon, so that the hour before is the same UTC day whenever the test runs.
USAGE_NOW = datetime(2026, 6, 15, 12, 30, tzinfo=timezone.utc)
USAGE_HOUR = USAGE_NOW.replace(minute=0)


def test_a_created_key_shows_its_secret_in_the_answer_only(operator):
    client = api_client(operator)
    made = client.post("/api/keys/", {"name": "ci", "model_names": ["kimi"], "rps_limit": 2, "tpm_limit": 9000,
                                      "max_concurrency": 3, "expires_at": (HOUR + timedelta(days=2)).isoformat()},
                       format="json")
    assert made.status_code == 201, made.content
    secret = made.json()["secret"]
    assert secret.startswith(made.json()["prefix"]) and made.json()["model_names"] == ["kimi"]
    listed = client.get("/api/keys/").content.decode() + client.get(f"/api/keys/{made.json()['id']}/").content.decode()
    assert made.json()["prefix"] in listed and secret not in listed and "secret" not in listed
    assert CallerKey.objects.get().rps_limit == 2


def test_bad_input_answers_400_naming_the_field(operator):
    answer = api_client(operator).post("/api/keys/", {"name": "x", "model_names": ["no spaces"]}, format="json")
    assert answer.status_code == 400 and "not a model name" in answer.json()["error"]["fields"]["model_names"][0]
    answer = api_client(operator).post("/api/keys/", {"name": "x", "rps_limit": -1}, format="json")
    assert answer.status_code == 400 and "above 0" in answer.json()["error"]["message"]
    assert not CallerKey.objects.exists()


def test_viewers_read_keys_and_usage_but_create_nothing(viewer, operator):
    keys.key_create(operator, "theirs")
    client = api_client(viewer)
    assert client.get("/api/keys/").json()["count"] == 1
    assert client.get("/api/keys/?mine=1").json()["count"] == 0
    assert client.get("/api/usage/").status_code == 200
    refused = client.post("/api/keys/", {"name": "mine"}, format="json")
    assert refused.status_code == 403 and CallerKey.objects.count() == 1


def test_an_operator_revokes_their_own_key_not_anothers_and_an_admin_anyones(operator):
    mine, _ = keys.key_create(operator, "mine")
    theirs, _ = keys.key_create(UserFactory(role="operator"), "theirs")
    client = api_client(operator)
    with mock.patch("deployments.gateway.changes.changed", autospec=True):
        assert client.post(f"/api/keys/{mine.pk}/revoke/").json()["revoked"] is True
        again = client.post(f"/api/keys/{mine.pk}/revoke/")
        assert again.status_code == 409 and again.json()["error"]["code"] == "revoked"
        refused = client.post(f"/api/keys/{theirs.pk}/revoke/")
        assert refused.status_code == 403 and "owner or an admin" in refused.json()["error"]["message"]
        patched = client.patch(f"/api/keys/{theirs.pk}/", {"rps_limit": 1}, format="json")
        assert patched.status_code == 403
        admin = api_client(UserFactory(is_superuser=True))
        assert admin.patch(f"/api/keys/{theirs.pk}/", {"rps_limit": 1}, format="json").json()["rps_limit"] == 1
        assert admin.post(f"/api/keys/{theirs.pk}/revoke/").status_code == 200
    assert CallerKey.objects.filter(revoked_at__isnull=False).count() == 2


def test_internal_keys_are_not_listed(operator):
    CallerKey.objects.create(owner=operator, name="gateway", prefix="vcp-i", digest="1" * 64, internal=True)
    assert api_client(operator).get("/api/keys/").json()["count"] == 0


@pytest.fixture
def usage(operator, monkeypatch):
    """Usage rows around USAGE_HOUR, read with the usage queries' clock at USAGE_NOW."""
    monkeypatch.setattr(selectors, "timezone", SimpleNamespace(now=lambda: USAGE_NOW))
    a, _ = keys.key_create(operator, "team-a")
    b, _ = keys.key_create(operator, "=HYPERLINK(1)")  # a name a spreadsheet would run
    d1, d2 = DeploymentFactory(name="kimi-1"), DeploymentFactory(name="kimi-2")
    rows = [(USAGE_HOUR, a, "kimi", d1, 3, 1, 30, 5, 7), (USAGE_HOUR, a, "kimi", d1, 2, 0, 20, 1, 1),  # two gateways
            (USAGE_HOUR - timedelta(hours=1), a, "kimi", d2, 1, 0, 10, 0, 4),
            (USAGE_HOUR - timedelta(days=1), b, "qwen", d2, 4, 2, 40, 0, 9)]
    for hour, key, name, d, req, err, prompt, reasoning, content in rows:
        Usage.objects.create(hour=hour, key=key, model_name=name, deployment=d, requests=req, errors=err,
                             prompt_tokens=prompt, reasoning_tokens=reasoning, content_tokens=content)
    return a, b


def test_usage_is_summed_by_hour_per_key(usage, viewer):
    a, _ = usage
    rows = api_client(viewer).get("/api/usage/?group=key&by=hour&days=2").json()["rows"]
    mine = [r for r in rows if r["label"].startswith("team-a")]
    assert [(r["period"], r["requests"], r["errors"], r["prompt_tokens"], r["reasoning_tokens"], r["content_tokens"])
            for r in mine] == [((USAGE_HOUR - timedelta(hours=1)).isoformat(), 1, 0, 10, 0, 4),
                               (USAGE_HOUR.isoformat(), 5, 1, 50, 6, 8)]
    assert mine[0]["label"] == f"team-a ({a.prefix}…)"


def test_usage_by_day_per_model_and_per_deployment(usage, viewer):
    client = api_client(viewer)
    by_day = {(r["period"], r["label"]): r["requests"]
              for r in client.get("/api/usage/?group=model&by=day&days=3").json()["rows"]}
    today, yesterday = USAGE_HOUR.replace(hour=0), USAGE_HOUR.replace(hour=0) - timedelta(days=1)
    assert by_day == {(today.isoformat(), "kimi"): 6, (yesterday.isoformat(), "qwen"): 4}
    totals = {}
    for r in client.get("/api/usage/?group=deployment&by=day&days=3").json()["rows"]:
        totals[r["label"]] = totals.get(r["label"], 0) + r["requests"]
    assert totals == {"kimi-1": 5, "kimi-2": 5}
    assert client.get("/api/usage/?group=deployment&by=day&days=1").json()["rows"] and \
        sum(r["requests"] for r in client.get("/api/usage/?group=model&days=1").json()["rows"]) == 6


def test_usage_csv_quotes_names_a_spreadsheet_would_run(usage, viewer):
    answer = api_client(viewer).get("/api/usage/?group=key&by=day&days=3&format=csv")
    assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv")
    table = list(csv.reader(io.StringIO(answer.content.decode())))
    assert table[0] == ["period", "group", "name", "requests", "errors", "refused", "prompt_tokens", "reasoning_tokens",
                        "content_tokens", "energy_j", "energy_net_j"]
    names = {row[2] for row in table[1:]}
    assert any(n.startswith("'=HYPERLINK(1)") for n in names) and not any(n.startswith("=") for n in names)
    assert sum(int(row[3]) for row in table[1:]) == 10


@pytest.mark.parametrize("query, words", [("group=user", "group: key, model or deployment"), ("by=week", "by: hour or day"),
                                          ("days=0", "days: a whole number"), ("days=abc", "days: a whole number")])
def test_bad_usage_parameters_answer_400_saying_what_is_allowed(viewer, query, words):
    answer = api_client(viewer).get(f"/api/usage/?{query}")
    assert answer.status_code == 400 and words in answer.json()["error"]["message"]


def test_the_deploy_api_takes_aliases_and_bounds_and_refuses_a_bad_alias(api_objects, operator, sent_tasks):
    deployment = api_objects["deployments"]
    body = {"model": deployment.model_id, "node": deployment.node.name, "name": "routed", "preset": "none", "gpus": [0],
            "replace": [deployment.pk], "aliases": ["kimi", "moonshot/kimi-k2"], "max_in_flight": 32, "queue_bound": 8,
            "media_domains": ["images.example.com"]}
    client = api_client(operator)
    bad = client.post("/api/deployments/", {**body, "aliases": ["kimi k2"]}, format="json")
    assert bad.status_code == 400 and "not a model name" in bad.json()["error"]["fields"]["aliases"][0]
    made = client.post("/api/deployments/", body, format="json")
    assert made.status_code == 202, made.content
    route = Route.objects.get(deployment_id=made.json()["id"])
    assert (route.names, route.max_in_flight, route.queue_bound, route.media_domains) == (
        ["kimi", "moonshot/kimi-k2"], 32, 8, ["images.example.com"])
    assert made.json()["route"]["aliases"] == ["kimi", "moonshot/kimi-k2"]
    assert "kimi" in made.json()["call"]["models"]


@pytest.mark.parametrize("domain", ["127.0.0.1", "169.254.169.254", "10.0.0.1", "::1", "localhost", "metadata",
                                    "metadata.google.internal", "printer.local", "router.home.arpa", "db.lan"])
def test_media_domains_inside_the_hosts_network_are_an_admins_to_allow(api_objects, operator, domain, sent_tasks):
    """The engine fetches media URLs from inside the GPU host: an operator letting it reach an address, a one-label
    name or a special-use or private one would be a blind SSRF from the host."""
    deployment = api_objects["deployments"]
    body = {"model": deployment.model_id, "node": deployment.node.name, "name": "media", "preset": "none", "gpus": [0],
            "replace": [deployment.pk], "media_domains": ["images.example.com", domain]}
    refused = api_client(operator).post("/api/deployments/", body, format="json")
    assert refused.status_code == 403, refused.content
    assert refused.json()["error"]["message"].startswith(f"Needs the admin role: {domain} is ")
    assert not Route.objects.filter(deployment__name="media").exists() and not sent_tasks.commit()
    made = api_client(UserFactory(role="admin")).post("/api/deployments/", body, format="json")
    assert made.status_code == 202, made.content
    assert Route.objects.get(deployment_id=made.json()["id"]).media_domains == ["images.example.com", domain]


def test_an_operator_keeps_the_internal_media_domain_an_admin_set_and_may_add_no_other():
    d = DeploymentFactory()
    keys.route_set(d, **keys.route_check(media_domains=["intranet.corp"], user=UserFactory(role="admin")))
    operator = UserFactory(role="operator")
    kept = keys.route_check(media_domains=["intranet.corp", "cdn.example.org"], user=operator, deployment=d)
    assert kept["media_domains"] == ["intranet.corp", "cdn.example.org"]
    with pytest.raises(keys.ServiceError, match="Needs the admin role: 10.1.2.3 is an IP address") as refused:
        keys.route_check(media_domains=["intranet.corp", "10.1.2.3"], user=operator, deployment=d)
    assert refused.value.code == "forbidden"


def test_metrics_count_usage_per_key_model_and_deployment_as_totals(usage, viewer_client):
    from tests.test_metrics import scrape, value

    a, b = usage
    samples = scrape(viewer_client)
    kimi_1 = {"key": "team-a", "key_prefix": a.prefix, "model": "kimi", "deployment": "kimi-1"}
    assert value(samples, "panel_gateway_requests_total", **kimi_1) == 5  # two gateways' rows for one group, summed
    assert value(samples, "panel_gateway_reasoning_tokens_total", **kimi_1) == 6
    assert value(samples, "panel_gateway_content_tokens_total", **kimi_1) == 8
    assert value(samples, "panel_gateway_errors_total", key="=HYPERLINK(1)", key_prefix=b.prefix, model="qwen",
                 deployment="kimi-2") == 2
    series = [labels for name, labels in samples if name == "panel_gateway_requests_total"]
    assert len(series) == 3 and not any("hour" in dict(labels) for labels in series)  # totals, not history


def test_each_key_gets_its_share_of_its_deployments_energy_by_output_tokens_gross_and_net_of_idle(usage, viewer):
    """kimi-1's hour: 1,000 J over 100 s, 20 of them idle at 2 W (40 J), so 1,000 − 2 × 100 = 800 J net; the engine
    counted 28 output tokens, team-a asked for 14 of them (5 + 7 + 1 + 1): half of each. kimi-2's hour before has 10
    J and no idle second: team-a's 4 tokens are all the engine counted, so all 10 J gross and no net. The day before
    (key b) has no reading: no energy, not zero."""
    a, b = usage
    d1, d2 = (Usage.objects.filter(deployment__name=n).first().deployment for n in ("kimi-1", "kimi-2"))
    DeploymentEnergy.objects.create(hour=USAGE_HOUR, deployment=d1, joules=1000, seconds=100, idle_joules=40,
                                    idle_seconds=20, output_tokens=28)
    DeploymentEnergy.objects.create(hour=USAGE_HOUR - timedelta(hours=1), deployment=d2, joules=10, seconds=5,
                                    output_tokens=3)  # fewer than team-a's 4: the keys' count is the whole
    client = api_client(viewer)
    rows = client.get("/api/usage/?group=key&by=hour&days=2").json()["rows"]
    mine = {r["period"]: (r["energy_j"], r["energy_net_j"]) for r in rows if r["label"].startswith("team-a")}
    assert mine == {USAGE_HOUR.isoformat(): (500.0, 400.0), (USAGE_HOUR - timedelta(hours=1)).isoformat(): (10.0, None)}
    by_day = {r["label"]: (r["energy_j"], r["energy_net_j"])
              for r in client.get("/api/usage/?group=key&by=day&days=3").json()["rows"]}
    assert by_day[f"team-a ({a.prefix}…)"] == (510.0, None)  # an hour without a net makes the day's net unknown
    assert by_day[f"=HYPERLINK(1) ({b.prefix}…)"] == (None, None)
    table = list(csv.reader(io.StringIO(client.get("/api/usage/?group=key&by=hour&days=2&format=csv").content.decode())))
    assert {tuple(row[-2:]) for row in table[1:] if row[2].startswith("team-a")} == {("500.0", "400.0"), ("10.0", "")}
