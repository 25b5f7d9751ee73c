"""The Hugging Face token set on the settings page is encrypted at rest with a key file only the panel's
user reads: the database holds ciphertext, the downloads still get the token."""
import importlib
import stat
from pathlib import Path
from unittest import mock

import pytest
from django.apps import apps
from django.db import connection

from deployments import modelcopies, sealed
from deployments.host import hub
from deployments.models import Secret
from deployments.services import repos
from tests.factories import ModelRepoFactory

pytestmark = pytest.mark.django_db
TOKEN = "hf_" + "Zq9" * 12


@pytest.fixture
def key_file(tmp_path, settings):
    settings.HF_TOKEN_KEY_FILE = str(tmp_path / "keys" / "hf-token.key")
    return Path(settings.HF_TOKEN_KEY_FILE)


def _stored() -> str:
    with connection.cursor() as cursor:  # what a database dump shows
        cursor.execute("SELECT value FROM deployments_secret WHERE name = %s", [Secret.HF_TOKEN])
        return cursor.fetchone()[0]


def test_the_stored_token_is_ciphertext_under_a_0600_key_and_the_hub_still_gets_it(key_file, operator_client):
    assert not key_file.exists()
    operator_client.post("/settings/", {"hf_token": TOKEN})
    assert TOKEN not in _stored() and _stored().startswith(sealed.PREFIX)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and TOKEN.encode() not in key_file.read_bytes()
    with mock.patch("deployments.host.hub.repo_info", autospec=True,
                    side_effect=hub.HubError("gated", True, "gated")) as repo_info:
        repos.model_inspect(ModelRepoFactory().pk)
    assert repo_info.call_args.kwargs["token"] == TOKEN  # what the downloads and the inspection use
    page = operator_client.get("/settings/").content.decode()
    assert TOKEN not in page and ">set<" in page  # never shown back


def test_a_token_stored_in_plain_text_before_is_encrypted_by_the_migration(key_file):
    Secret.objects.create(name=Secret.HF_TOKEN, value=TOKEN)  # as the code before this one stored it
    assert modelcopies.hf_token() == TOKEN  # read as it is until migrated
    migration = importlib.import_module("deployments.migrations.0016_secret_sealed")
    migration.seal_plaintext(apps, None)
    migration.seal_plaintext(apps, None)  # twice: a sealed value is left as it is
    assert TOKEN not in _stored() and sealed.unseal(_stored()) == TOKEN and modelcopies.hf_token() == TOKEN
    migration.unseal(apps, None)
    assert _stored() == TOKEN


def test_without_the_key_file_the_token_is_unreadable_and_the_environment_token_is_used(key_file, settings, caplog):
    repos.hf_token_set(TOKEN)
    key_file.rename(key_file.with_name("elsewhere"))  # a host the key file was not copied to
    settings.HF_TOKEN = "hf_from_the_environment"
    assert modelcopies.hf_token() == "hf_from_the_environment"
    assert str(key_file) in caplog.text and TOKEN not in caplog.text
    key_file.with_name("elsewhere").rename(key_file)
    assert modelcopies.hf_token() == TOKEN


def test_a_second_process_making_the_key_keeps_the_first_ones(key_file):
    sealed._make_key(key_file)
    first = key_file.read_bytes()
    sealed._make_key(key_file)  # lost the race: the file another process made stays
    assert key_file.read_bytes() == first and list(key_file.parent.iterdir()) == [key_file]
