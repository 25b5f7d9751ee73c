"""panelctl keys against the real ASGI server: create prints the secret alone on stdout (so
`KEY=$(panelctl keys create ci)` works), list shows prefix, scope and limits but never the secret, revoke by
name; bad input exits 2 with the reason; panelctl deploy sends --alias and the bounds."""
from unittest import mock

import pytest

from deployments.gateway.config import digest
from deployments.gateway.models import CallerKey
from panelctl import cli, keys
from panelctl.deployments import cmd_deploy
from plumbing import tokens

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def login(live_server_asgi, operator):
    with mock.patch("deployments.gateway.changes.changed", autospec=True):
        yield ["--url", live_server_asgi, "--token", tokens.issue(operator)]


def test_create_list_and_revoke_a_key(login, capsys):
    assert cli.main([*login, "keys", "create", "ci-bot", "--model", "kimi", "--rps", "5", "--tpm", "1000",
                     "--concurrency", "2", "--expires", "30d"]) == 0
    out, err = capsys.readouterr()
    secret = out.strip()
    key = CallerKey.objects.get()
    assert out == secret + "\n" and key.digest == digest(secret) and "shown this once" in err
    assert (key.model_names, key.rps_limit, key.tpm_limit, key.max_concurrency) == (["kimi"], 5.0, 1000, 2)
    assert cli.main([*login, "keys", "list"]) == 0
    listed = capsys.readouterr().out
    assert key.prefix in listed and "ci-bot" in listed and "kimi" in listed and "5/s 1000 tok/min 2 at once" in listed
    assert secret not in listed
    assert cli.main([*login, "keys", "revoke", "ci-bot"]) == 0
    assert "every gateway refuses it within a second" in capsys.readouterr().err
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert cli.main([*login, "keys", "revoke", "ci-bot"]) == 5  # no live key of that name any more
    assert "None of your live keys is named 'ci-bot'" in capsys.readouterr().err


def test_bad_input_exits_2_with_the_reason(login, capsys):
    assert cli.main([*login, "keys", "create", "x", "--model", "two words"]) == 2
    assert "is not a model name" in capsys.readouterr().err
    assert cli.main([*login, "keys", "create", "x", "--expires", "soon"]) == 2
    assert "write 12h, 30d or a date" in capsys.readouterr().err
    assert not CallerKey.objects.exists()


def test_expiry_is_read_as_hours_days_or_a_utc_date():
    assert keys.expiry("2027-01-31") == "2027-01-31T00:00:00+00:00"
    assert keys.expiry("") is None and keys.expiry("12h") > keys.expiry("2026-01-01")


def test_deploy_sends_the_aliases_and_the_bounds():
    panel = mock.Mock()
    panel.get.side_effect = lambda path, **kw: ({"results": [{"id": 1}]} if path == "models/" else
                                                {"gpus": [{"index": 0}]})
    panel.post.return_value = {"name": "d", "id": 1, "gpus": [0], "port": 8000, "engine_args": {}}
    args = cli.parser().parse_args(["deploy", "1", "--node", "n1", "--alias", "kimi", "--alias", "k2",
                                    "--max-in-flight", "8", "--queue-bound", "2", "--media-domain", "img.example.com"])
    assert cmd_deploy(panel, args) == 0
    body = panel.post.call_args.args[1]
    assert (body["aliases"], body["max_in_flight"], body["queue_bound"], body["media_domains"]) == (
        ["kimi", "k2"], 8, 2, ["img.example.com"])
