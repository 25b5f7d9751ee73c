"""The deployment page: the start-up card is titled by what it shows, and the engine's whole
command line is on the page with a Copy button, secrets not in it."""
import shlex

import pytest
from django.urls import reverse

from deployments import selectors
from tests.factories import DeploymentFactory, ModelCopyFactory

pytestmark = pytest.mark.django_db


def _deployment(**kwargs):
    copy = ModelCopyFactory(path="/models/acme--tiny-chat")
    return DeploymentFactory(model=copy.model, node=copy.node, **kwargs)


@pytest.mark.parametrize("status, title", [("loading", "Loading"), ("ready", "Start-up"), ("stopped", "Last start-up")])
def test_the_start_up_card_says_loading_only_while_it_loads(operator_client, status, title):
    d = _deployment(status=status)
    html = operator_client.get(reverse("deployment-detail", args=[d.pk])).content.decode()
    assert f'<h2 style="margin-top:0" id="loading-title">{title}</h2>' in html


def test_the_engine_command_is_shown_whole_with_a_copy_button_and_no_secret(operator_client, settings):
    d = _deployment(status="ready", engine_args={"max-num-seqs": 8, "served-model-name": "acme/tiny chat"},
                    env={"VLLM_CPU_KVCACHE_SPACE": "1", "MY_TOKEN": "hunter2", "MY_SECRET": "sk-very-secret"})
    command = selectors.deployment_command(d)
    words = shlex.split(command.splitlines()[1])
    assert words[words.index(settings.VLLM_BIN):][:3] == [settings.VLLM_BIN, "serve", "/models/acme--tiny-chat"]
    assert "VLLM_CPU_KVCACHE_SPACE=1" in words and "--max-num-seqs" in words
    assert words[words.index("--served-model-name") + 1] == "acme/tiny chat"  # quoted as one word
    assert "sk-very-secret" not in command and "hunter2" not in command
    # Its key is named, never shown; it listens on loopback, behind the node's gateway.
    assert command.splitlines()[0] == "# export MY_TOKEN MY_SECRET VLLM_API_KEY first (secret: never shown here)"
    assert words[words.index("--host") + 1] == "127.0.0.1"
    html = operator_client.get(reverse("deployment-detail", args=[d.pk])).content.decode()
    assert 'data-copy="engine-command"' in html and 'id="engine-command"' in html
    assert "sk-very-secret" not in html and "hunter2" not in html
