"""Secrets at rest and at start: a real SECRET_KEY, private files, no secret on a command line, hashed tokens."""
import io
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import redis
import yaml

from panelctl import cli, launcher
from tests.conftest import ROOT


def _settings_load(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import django; django.setup()"], cwd=ROOT, capture_output=True,
                          text=True, env={**env, "DJANGO_SETTINGS_MODULE": "controlpanel.settings"})


@pytest.mark.parametrize("key", ["", "change-me", "insecure-dev-key-set-SECRET_KEY-in-production", "short",
                                 "django-insecure-abcdefghijklmnopqrstuvwxyz0123456789"])
def test_production_refuses_a_missing_or_published_secret_key(tmp_path, monkeypatch, key):
    from django.core.exceptions import ImproperlyConfigured

    from controlpanel import settings as panel_settings

    monkeypatch.setattr(panel_settings, "DEBUG", False)
    monkeypatch.setattr(panel_settings, "VAR_DIR", tmp_path)
    monkeypatch.delenv("SECRET_KEY_FILE", raising=False)
    monkeypatch.setenv("SECRET_KEY", key)
    with pytest.raises(ImproperlyConfigured, match="SECRET_KEY is missing, too short or a published value"):
        panel_settings._secret_key()
    monkeypatch.setenv("SECRET_KEY", "k" * 50)
    assert panel_settings._secret_key() == "k" * 50


def test_the_settings_refuse_to_load_with_a_published_key_and_load_with_a_long_one(tmp_path):
    """The check above is what loading the settings runs (one process each: a refused load cannot be undone)."""
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "SECRET_KEY_FILE", "DEBUG")}
    result = _settings_load({**env, "SECRET_KEY": "change-me", "PANEL_VAR_DIR": str(tmp_path)})
    assert result.returncode != 0 and "SECRET_KEY is missing, too short or a published value" in result.stderr
    assert _settings_load({**env, "SECRET_KEY": "k" * 50, "PANEL_VAR_DIR": str(tmp_path)}).returncode == 0


def test_the_launcher_makes_one_private_key_and_the_settings_read_it(tmp_path):
    key = launcher.ensure_secret_key(tmp_path)
    assert len(key) >= 50 and (tmp_path / "secret_key").stat().st_mode & 0o777 == 0o600
    assert launcher.ensure_secret_key(tmp_path) == key
    env = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "SECRET_KEY_FILE", "DEBUG")}
    assert _settings_load({**env, "PANEL_VAR_DIR": str(tmp_path)}).returncode == 0


def test_the_first_admins_password_never_appears_on_a_command_line(tmp_path, process_env):
    env = {**process_env, "PANEL_ADMIN_PASSWORD": "pw-visible-in-ps-1", "PANEL_VAR_DIR": str(tmp_path)}
    with mock.patch.object(launcher.subprocess, "run", wraps=subprocess.run) as run:
        username, password = launcher.ensure_admin(env)
    argv = " ".join(" ".join(call.args[0]) for call in run.call_args_list)
    assert password == "pw-visible-in-ps-1" and password not in argv
    assert all("PANEL_ADMIN_PASSWORD" not in call.kwargs["env"] for call in run.call_args_list)
    from django.contrib.auth import get_user_model
    assert get_user_model().objects.get(username=username).check_password(password)


def test_the_embedded_redis_refuses_clients_without_its_password(tmp_path):
    children = launcher.Children()
    try:
        url = launcher.start_embedded_redis(children, {}, tmp_path, password="pw-redis-1")
        assert "pw-redis-1" not in " ".join(children.procs[0][1].args)
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis.from_url(url.replace(":pw-redis-1@", "")).ping()
        assert redis.Redis.from_url(url).ping()
    finally:
        children.stop()


def test_the_cli_token_file_is_private_from_its_first_byte(tmp_path):
    config = tmp_path / "panelctl.json"
    old = os.umask(0)
    try:  # with chmod disabled, only a file created 0600 ends up 0600
        with mock.patch.object(cli, "CONFIG", config), mock.patch.object(cli.Panel, "get", autospec=True), \
                mock.patch.object(Path, "chmod", autospec=True):
            cli.cmd_login(None, mock.Mock(url="http://panel", token="pct_secret", token_stdin=False))
    finally:
        os.umask(old)
    assert config.stat().st_mode & 0o777 == 0o600 and "pct_secret" in config.read_text()


def test_the_cli_reads_the_login_token_from_standard_input_not_its_command_line(tmp_path, monkeypatch, capsys):
    config = tmp_path / "panelctl.json"
    monkeypatch.setattr(cli, "CONFIG", config)
    monkeypatch.setattr("sys.stdin", io.StringIO("pct_from_stdin\n"))
    with mock.patch.object(cli.Panel, "get", autospec=True) as asked:
        assert cli.main(["login", "--url", "http://panel", "--token-stdin"]) == 0
    assert asked.call_args.args[0].http.headers["Authorization"] == "Token pct_from_stdin"
    assert "pct_from_stdin" in config.read_text()
    monkeypatch.setattr("sys.stdin", io.StringIO("pct_piped\n"))  # not a terminal: read too, without the flag
    with mock.patch.object(cli.Panel, "get", autospec=True):
        assert cli.main(["login", "--url", "http://panel"]) == 0
    assert "pct_piped" in config.read_text()
    with mock.patch.object(cli.Panel, "get", autospec=True):
        assert cli.main(["login", "--url", "http://panel", "--token", "pct_argv"]) == 0
    assert "visible to every local user (ps)" in capsys.readouterr().err  # still taken, with the warning


def test_compose_requires_passwords_for_redis_and_postgresql():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    env = compose["services"]["web"]["environment"]
    assert "${REDIS_PASSWORD:?" in env["REDIS_URL"] and "${POSTGRES_PASSWORD:?" in env["DATABASE_URL"]
    assert "requirepass" in " ".join(compose["services"]["redis"]["command"])
    assert compose["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert "SECRET_KEY=change-me" not in (ROOT / ".env.example").read_text()


@pytest.mark.django_db
def test_an_api_token_is_shown_once_and_stored_hashed(viewer_client, viewer):
    from rest_framework.authtoken.models import Token

    page = viewer_client.post("/account/token/", {"action": "create"}).content.decode()
    import re
    raw = re.search(r'<code id="new-token">([^<]+)</code>', page).group(1)
    assert Token.objects.get(user=viewer).key != raw and raw not in viewer_client.get("/account/").content.decode()
    assert viewer_client.get("/api/nodes/", HTTP_AUTHORIZATION=f"Token {raw}").status_code == 200


@pytest.mark.django_db
def test_tokens_made_before_hashing_keep_working_once_migrated(client, viewer):
    import importlib

    from django.apps import apps
    from rest_framework.authtoken.models import Token

    old = Token.objects.create(user=viewer, key="a" * 40).key  # a plain key, as DRF made them
    importlib.import_module("deployments.migrations.0008_hash_api_tokens").hash_keys(apps, None)
    assert not Token.objects.filter(key=old).exists()
    assert client.get("/api/nodes/", HTTP_AUTHORIZATION=f"Token {old}").status_code == 200
