"""A Ray cluster's token is sealed at rest like the Hugging Face token: the row holds ciphertext
(191 characters, which PostgreSQL must hold), the cluster's processes get the token; a token stored in plain text
before is sealed by the migration."""
import importlib
from pathlib import Path
from unittest import mock

import pytest
from django.apps import apps
from django.db import connection

from deployments import sealed
from deployments.host import processes
from deployments.models import Deployment
from deployments.node import raycluster
from tests.factories import DeploymentFactory

pytestmark = pytest.mark.django_db
RAY = {"distributed-executor-backend": "ray"}


@pytest.fixture
def key_file(tmp_path, settings):
    settings.HF_TOKEN_KEY_FILE = str(tmp_path / "keys" / "hf-token.key")
    return Path(settings.HF_TOKEN_KEY_FILE)


def _stored(pk) -> str:
    with connection.cursor() as cursor:  # what a database dump shows
        cursor.execute("SELECT ray_token FROM deployments_deployment WHERE id = %s", [pk])
        return cursor.fetchone()[0]


def test_the_ray_head_stores_its_token_sealed_and_hands_the_cluster_the_token(key_file, tmp_path, settings):
    settings.VAR_DIR = tmp_path
    d = DeploymentFactory(status=Deployment.Status.STARTING, master_port=29611, engine_args=RAY)
    with mock.patch("deployments.host.raynode.check_installed", autospec=True), \
         mock.patch("deployments.host.processes.port_free", autospec=True, return_value=True), \
         mock.patch("deployments.host.firewall.check", autospec=True, return_value=""), \
         mock.patch("deployments.host.firewall.guard", autospec=True, return_value="") as guard, \
         mock.patch("deployments.host.processes.launch", autospec=True, return_value=processes.EngineHandle(4242, 4242)) as launch:
        raycluster.head_start(d)
    token = launch.call_args.args[0].env["RAY_AUTH_TOKEN"]
    stored = _stored(d.pk)
    assert len(token) == 64 and sealed.is_sealed(stored) and token not in stored and sealed.unseal(stored) == token
    assert raycluster.token(Deployment.objects.get(pk=d.pk)) == token  # a worker node's agent reads it back
    assert guard.call_args.args[:2] == (d.marker, [4242])  # the Ray head's ports admit the deployment's nodes only


def test_a_token_stored_in_plain_text_before_is_sealed_by_the_migration(key_file):
    d = DeploymentFactory(master_port=29612, engine_args=RAY, ray_token="t" * 64)  # as the code before stored it
    assert raycluster.token(d) == "t" * 64  # read as it is until migrated
    migration = importlib.import_module("deployments.migrations.0018_ray_token_sealed")
    migration.seal_plaintext(apps, None)
    migration.seal_plaintext(apps, None)  # twice: a sealed value is left as it is
    assert sealed.is_sealed(_stored(d.pk)) and raycluster.token(Deployment.objects.get(pk=d.pk)) == "t" * 64
    migration.unseal(apps, None)
    assert _stored(d.pk) == "t" * 64
