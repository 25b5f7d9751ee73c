"""The account page's gateway keys (the secret shown once with a Copy button, revoke), the Usage page (charts'
data and totals per key, model or deployment) and the deploy form's gateway fields (aliases, bounds, media
domains, with clear errors)."""
import json
from datetime import datetime, timedelta, timezone
from unittest import mock

import pytest
from django.urls import reverse

from deployments.gateway import keys
from deployments.gateway.models import CallerKey, Route, Usage
from deployments.models import DeploymentEnergy
from tests.factories import DeploymentFactory, ModelCopyFactory, ModelRepoFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.django_db
HOUR = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)


@pytest.fixture(autouse=True)
def _told():
    with mock.patch("deployments.gateway.changes.changed", autospec=True):
        yield


def test_a_key_made_on_the_account_page_is_shown_once_with_a_copy_button(operator_client):
    made = operator_client.post(reverse("key-create"), {"name": "notebook", "model_names": "kimi qwen3",
                                                        "rps_limit": "2.5", "expires_days": "30"})
    page = made.content.decode()
    key = CallerKey.objects.get()
    secret = page.split('id="new-key-secret" class="clip">')[1].split("<")[0]
    assert made.status_code == 200 and secret.startswith(key.prefix) and 'data-copy="new-key-secret"' in page
    assert key.model_names == ["kimi", "qwen3"] and key.rps_limit == 2.5 and key.expires_at > HOUR + timedelta(days=29)
    again = operator_client.get(reverse("account")).content.decode()
    assert secret not in again
    assert key.prefix in again
    assert "kimi, qwen3" in again
    assert "2.5/s" in again


def test_a_bad_key_form_answers_400_with_the_fields_message_and_makes_nothing(operator_client):
    answer = operator_client.post(reverse("key-create"), {"name": "x", "model_names": "ok bad;name"})
    assert answer.status_code == 400 and "is not a model name" in answer.content.decode()
    assert not CallerKey.objects.exists()


def test_revoke_on_the_account_page_and_the_list_says_revoked(operator, operator_client):
    key, _ = keys.key_create(operator, "old")
    answer = operator_client.post(reverse("key-revoke", args=[key.pk]), follow=True)
    assert "revoked: every gateway refuses it within a second" in answer.content.decode()
    assert 'class="badge bad">revoked' in answer.content.decode()
    assert CallerKey.objects.get().revoked_at is not None


def test_an_operator_sees_only_their_keys_and_an_admin_everyones(operator, operator_client, client):
    keys.key_create(operator, "mine")
    keys.key_create(UserFactory(role="operator"), "someone-elses")
    page = operator_client.get(reverse("account")).content.decode()
    assert "mine" in page and "someone-elses" not in page
    client.force_login(UserFactory(is_superuser=True))
    page = client.get(reverse("account")).content.decode()
    assert "mine" in page and "someone-elses" in page and "<th>Owner</th>" in page


def test_a_viewer_sees_no_key_form(viewer_client):
    page = viewer_client.get(reverse("account")).content.decode()
    assert "Creating keys needs the operator role" in page and 'id="key-form"' not in page


def test_the_usage_page_draws_every_measure_per_key_and_totals_them(operator, viewer_client):
    key, _ = keys.key_create(operator, "team-a")
    d = DeploymentFactory(name="kimi-1")
    for hour, n in ((HOUR, 3), (HOUR - timedelta(hours=2), 1)):
        Usage.objects.create(hour=hour, key=key, model_name="kimi", deployment=d, requests=n, errors=1, prompt_tokens=10 * n,
                             reasoning_tokens=n, content_tokens=2 * n)
    page = viewer_client.get(reverse("usage")).content.decode()
    data = json.loads(page.split('<script id="usage-data" type="application/json">')[1].split("</script>")[0])
    label = f"team-a ({key.prefix}…)"
    # Every hour of the default 2-day window, zero where unused (one dot per key on a 2027-2029 axis was seen).
    periods = data["periods"]
    assert data["labels"] == [label] and len(periods) == 48 and all(b - a == 3600 for a, b in zip(periods, periods[1:]))
    at = {int(HOUR.timestamp()): 3, int((HOUR - timedelta(hours=2)).timestamp()): 1}
    assert data["series"]["requests"][label] == [at.get(t, 0) for t in periods]
    assert data["series"]["content_tokens"][label] == [2 * at.get(t, 0) for t in periods]
    assert "<td class=\"num\">4</td>" in page and 'id="chart-output"' in page and "usage.js" in page
    assert '<td class="num energy">—</td>' in page  # no energy reading of kimi-1: none, not zero
    # An hour of kimi-1 read at 90 J for 27 output tokens, 9 of them team-a's (3 + 6), idle at 0.5 W: a third of 90 J,
    # and a third of 90 − 0.5 × 60 J net.
    DeploymentEnergy.objects.create(hour=HOUR, deployment=d, joules=90, seconds=60, idle_joules=5, idle_seconds=10,
                                    output_tokens=27)
    page = viewer_client.get(reverse("usage")).content.decode()
    assert '<td class="num energy">30.0 (20.0)</td>' in page
    by_model = viewer_client.get(reverse("usage") + "?group=model&by=day").content.decode()
    assert '"labels": ["kimi"]' in by_model


def test_the_usage_page_says_why_a_window_is_refused(viewer_client):
    answer = viewer_client.get(reverse("usage") + "?days=999")
    assert answer.status_code == 400 and "days: a whole number from 1 to 366" in answer.content.decode()


def _cpu_model():
    node = NodeFactory(name="cpu-01", ram_total=64 * 2**30, cpu_count=4)
    model = ModelRepoFactory(repo_id="acme/tiny", files=[{"path": "model.safetensors", "size": 2**20}], total_size=2**20)
    ModelCopyFactory(model=model, node=node, path="/models/tiny")
    return model, node


FORM = {"port": 8001, "tp": 1, "pp": 1, "dp": 1, "gpu_memory_utilization": 0.9, "kv_cache_dtype": "auto",
        "stall_seconds": 600}


def test_the_deploy_form_sets_aliases_bounds_and_media_domains(operator_client, sent_tasks):
    model, node = _cpu_model()
    url = reverse("model-deploy", args=[model.pk]) + f"?node={node.pk}"
    assert 'name="route-aliases"' in operator_client.get(url).content.decode()
    answer = operator_client.post(url, {**FORM, "node_id": node.pk, "route-aliases": "kimi, moonshot/k2",
                                        "route-max_in_flight": "16", "route-queue_bound": "4",
                                        "route-media_domains": "images.example.com"})
    assert answer.status_code == 302, answer.content.decode()[:2000]
    route = Route.objects.get()
    assert (route.names, route.max_in_flight, route.queue_bound, route.media_domains) == (
        ["kimi", "moonshot/k2"], 16, 4, ["images.example.com"])
    edit = operator_client.get(reverse("deployment-edit", args=[route.deployment_id])).content.decode()
    assert 'value="kimi moonshot/k2"' in edit


@pytest.mark.parametrize("field, value, words", [("route-aliases", "kimi;ls", "is not a model name"),
                                                 ("route-media_domains", "http://evil/x", "is not a domain name"),
                                                 ("route-media_domains", "169.254.169.254", "Needs the admin role"),
                                                 ("route-max_in_flight", "0", "greater than or equal to 1")])
def test_a_bad_gateway_field_on_the_deploy_form_answers_400_and_deploys_nothing(operator_client, field, value, words, sent_tasks):
    model, node = _cpu_model()
    url = reverse("model-deploy", args=[model.pk]) + f"?node={node.pk}"
    answer = operator_client.post(url, {**FORM, "node_id": node.pk, field: value})
    assert answer.status_code == 400 and words in answer.content.decode() and not sent_tasks.commit()
    assert not Route.objects.exists()
