"""Callers' keys and routes through deployments/gateway/keys.py: the secret is returned once and only its digest
kept, each commit tells the gateways, every check refuses bad input with its own message, and what is written is
what the gateway's own loader (config.load_keys + keyset.authenticate) accepts or refuses."""
import hashlib
from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from deployments.gateway import config, keys, keyset
from deployments.gateway.models import CallerKey, Route
from plumbing.errors import ServiceError
from tests.factories import DeploymentFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def told():
    with mock.patch("deployments.gateway.changes.changed", autospec=True) as changed:
        yield changed


def test_the_gateways_are_told_only_once_the_write_is_committed(operator, told, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        keys.key_create(operator, "ci-bot")
        assert not told.called  # still in the transaction: nothing the gateways could reload yet
    told.assert_called_once_with("keys")


def test_a_new_key_returns_its_secret_once_and_keeps_only_its_digest_and_prefix(operator, told):
    key, secret = keys.key_create(operator, "ci-bot")
    assert secret.startswith("vcp-") and len(secret) == 4 + 43  # token_urlsafe(32): 43 characters
    row = CallerKey.objects.get(pk=key.pk)
    assert row.digest == hashlib.sha256(secret.encode()).hexdigest() and row.prefix == secret[:12]
    assert secret not in repr(list(CallerKey.objects.values()))  # nowhere in the row
    assert keys.key_create(operator, "other")[1] != secret


def test_a_created_key_is_accepted_by_the_gateway_loader_and_a_revoked_one_refused(operator, told):
    key, secret = keys.key_create(operator, "team-a", model_names=["kimi"], rps=5, tpm=1000, concurrency=2)
    snapshot = config.Snapshot(keys=config.load_keys())
    checked = keyset.authenticate(snapshot, f"Bearer {secret}")
    assert (checked.model_names, checked.rps, checked.tpm, checked.concurrency) == (frozenset({"kimi"}), 5.0, 1000, 2)
    keys.key_revoke(key, operator)
    with pytest.raises(keyset.Refused, match="revoked") as refused:
        keyset.authenticate(config.Snapshot(keys=config.load_keys()), f"Bearer {secret}")
    assert refused.value.status == 401 and secret not in refused.value.message


def test_scope_expiry_and_limits_are_changed(operator, told):
    d = DeploymentFactory()
    key, _ = keys.key_create(operator, "k")
    when = timezone.now() + timedelta(days=3)
    keys.key_update(key, operator, model_names=["a", "a", "org/b:v1"], deployments=[d.pk], expires_at=when, rps=0.5,
                    concurrency=None)
    key.refresh_from_db()
    assert key.model_names == ["a", "org/b:v1"] and list(key.deployments.all()) == [d]
    assert key.expires_at == when and key.rps_limit == 0.5 and key.max_concurrency is None
    keys.key_update(key, operator, tpm=100)  # only what is given changes
    key.refresh_from_db()
    assert key.tpm_limit == 100 and key.rps_limit == 0.5


@pytest.mark.parametrize("kwargs, field, words", [
    ({"name": ""}, "name", "Give the key a name"),
    ({"model_names": ["ok", "bad name"]}, "model_names", "'bad name' is not a model name"),
    ({"model_names": ["-flag"]}, "model_names", "starting with a letter or digit"),
    ({"model_names": "kimi"}, "model_names", "a list of model names"),
    ({"expires_at": timezone.now() - timedelta(minutes=1)}, "expires_at", "in the past"),
    ({"rps": 0}, "rps_limit", "above 0"),
    ({"rps": "fast"}, "rps_limit", "a number"),
    ({"tpm": 1.5}, "tpm_limit", "a whole number"),
    ({"concurrency": -1}, "max_concurrency", "above 0"),
    ({"deployments": [999999]}, "deployments", "No deployment 999999"),
])
def test_bad_input_is_refused_naming_its_field(operator, kwargs, field, words):
    args = {"name": "k", **kwargs}
    with pytest.raises(ServiceError) as refused:
        keys.key_create(operator, args.pop("name"), **args)
    assert refused.value.field == field and words in refused.value.message
    assert not CallerKey.objects.exists()


def test_a_second_live_key_of_the_same_name_is_refused_until_the_first_is_revoked(operator, told):
    key, _ = keys.key_create(operator, "same")
    with pytest.raises(ServiceError, match="already") as refused:
        keys.key_create(operator, "same")
    assert refused.value.code == "exists"
    keys.key_revoke(key, operator)
    keys.key_create(operator, "same")
    with pytest.raises(ServiceError, match="revoked already"):
        keys.key_revoke(key, operator)


def test_operators_manage_their_own_keys_admins_everyones_viewers_none(operator, viewer, told):
    other = UserFactory(role="operator")
    admin = UserFactory(is_superuser=True)
    key, _ = keys.key_create(other, "theirs")
    for user in (operator, viewer):
        with pytest.raises(ServiceError, match="Only its owner or an admin") as refused:
            keys.key_revoke(key, user)
        assert refused.value.code == "forbidden"
    with pytest.raises(ServiceError, match="operator role"):
        keys.key_create(viewer, "mine")
    keys.key_update(key, admin, rps=1)
    keys.key_revoke(key, admin)
    assert CallerKey.objects.get(pk=key.pk).revoked_at is not None


def test_the_panels_internal_keys_are_never_changed_or_revoked_here(operator):
    admin = UserFactory(is_superuser=True)
    internal = CallerKey.objects.create(owner=admin, name="prometheus", prefix="vcp-x", digest="0" * 64, internal=True)
    with pytest.raises(ServiceError, match="panel's own"):
        keys.key_revoke(internal, admin)
    assert CallerKey.objects.get(pk=internal.pk).revoked_at is None


def test_a_route_keeps_checked_aliases_bounds_and_domains_and_tells_the_gateways(told, django_capture_on_commit_callbacks):
    d = DeploymentFactory()
    fields = keys.route_check(aliases=["kimi", "kimi", "moonshot/k2"], max_in_flight="64", queue_bound=0,
                              media_domains=["Images.Example.com.", "cdn.example.org"])
    with django_capture_on_commit_callbacks(execute=True):
        keys.route_set(d, **fields)
    route = Route.objects.get(deployment=d)
    assert route.names == ["kimi", "moonshot/k2"] and route.max_in_flight == 64 and route.queue_bound == 0
    assert route.media_domains == ["images.example.com", "cdn.example.org"]
    told.assert_called_with("routes")
    keys.route_set(d, **keys.route_check())  # defaults: no aliases, bound by --max-num-seqs, queue 256
    route.refresh_from_db()
    assert (route.names, route.max_in_flight, route.queue_bound, route.media_domains) == ([], None, 256, [])


@pytest.mark.parametrize("kwargs, field, words", [
    ({"aliases": ["kimi k2"]}, "aliases", "'kimi k2' is not a model name"),
    ({"aliases": ["a;rm -rf /"]}, "aliases", "not a model name"),
    ({"max_in_flight": 0}, "max_in_flight", "from 1 to"),
    ({"max_in_flight": "many"}, "max_in_flight", "a whole number"),
    ({"queue_bound": 10**9}, "queue_bound", "from 0 to 100,000"),
    ({"media_domains": ["http://x.com/a"]}, "media_domains", "is not a domain name"),
    ({"media_domains": ["*.example.com"]}, "media_domains", "a subdomain is an entry of its own"),
])
def test_a_bad_route_field_is_refused_naming_it(kwargs, field, words):
    with pytest.raises(ServiceError) as refused:
        keys.route_check(**kwargs)
    assert refused.value.field == field and words in refused.value.message
