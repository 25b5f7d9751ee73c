"""Secure cookies, HSTS and the proxy's HTTPS header are set from the environment, and
the passwords people set meet Django's four validators."""
import importlib.util

import pytest
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.test import Client, override_settings

from controlpanel import settings as panel_settings
from tests.factories import PASSWORD, UserFactory

HTTPS_ENV = {"SESSION_COOKIE_SECURE": "true", "CSRF_COOKIE_SECURE": "1", "SECURE_HSTS_SECONDS": "31536000",
             "SECURE_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO,https"}
NAMES = ["SESSION_COOKIE_SECURE", "CSRF_COOKIE_SECURE", "SECURE_HSTS_SECONDS", "SECURE_PROXY_SSL_HEADER"]


def _settings_with(monkeypatch, env: dict):
    """controlpanel/settings.py read afresh under `env` (a module of its own: Django's settings stay as they are)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    spec = importlib.util.spec_from_file_location("settings_probe", panel_settings.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_the_variables_the_panel_serves_plain_http(monkeypatch):
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    probe = _settings_with(monkeypatch, {})
    assert [getattr(probe, n) for n in NAMES] == [False, False, 0, None]


def test_a_malformed_proxy_header_is_refused_at_start(monkeypatch):
    with pytest.raises(ImproperlyConfigured, match="HTTP_X_FORWARDED_PROTO,https"):
        _settings_with(monkeypatch, {"SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto"})


@pytest.mark.django_db
def test_the_environment_turns_on_secure_cookies_hsts_and_the_proxy_header(monkeypatch):
    probe = _settings_with(monkeypatch, HTTPS_ENV)
    values = {n: getattr(probe, n) for n in NAMES}
    assert values == {"SESSION_COOKIE_SECURE": True, "CSRF_COOKIE_SECURE": True, "SECURE_HSTS_SECONDS": 31536000,
                      "SECURE_PROXY_SSL_HEADER": ("HTTP_X_FORWARDED_PROTO", "https")}
    user = UserFactory(role="viewer")
    with override_settings(**values):
        behind_proxy = Client().get("/accounts/login/", HTTP_X_FORWARDED_PROTO="https")
        plain = Client().get("/accounts/login/")
        login = Client().post("/accounts/login/", {"username": user.username, "password": PASSWORD},
                              HTTP_X_FORWARDED_PROTO="https")
    assert login.status_code == 302 and login.cookies["sessionid"]["secure"] is True
    assert behind_proxy.status_code == 200
    assert behind_proxy["Strict-Transport-Security"] == "max-age=31536000"
    assert "Strict-Transport-Security" not in plain  # HSTS only over HTTPS, as the proxy's header says
    assert behind_proxy.cookies["csrftoken"]["secure"] is True


def test_people_set_passwords_that_pass_the_four_validators(django_user_model):
    user = django_user_model(username="alice", email="alice@example.com")
    for weak in ("short-pw-1", "password1234", "123456789012345", "alice@example.com1"):
        with pytest.raises(ValidationError):
            validate_password(weak, user)
    validate_password(PASSWORD, user)  # the tests' users keep working
    assert len(panel_settings.AUTH_PASSWORD_VALIDATORS) == 4


@pytest.mark.django_db
def test_the_account_page_refuses_a_weak_new_password(viewer, viewer_client):
    weak = viewer_client.post("/account/", {"old_password": PASSWORD, "new_password1": "abc12345", "new_password2": "abc12345"})
    assert weak.status_code == 400 and "at least 12 characters" in weak.content.decode()
    viewer.refresh_from_db()
    assert viewer.check_password(PASSWORD)
