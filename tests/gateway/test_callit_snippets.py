"""Call it's snippets run as shown: the deployment page's curl command, pasted into a shell,
and its Python, run with the official openai client, reach the deployment through the real gateway (in a
thread, in front of a known-schedule server) with a caller key in OPENAI_API_KEY; with a key it does not know, the
gateway refuses them."""
import json
import os
import subprocess
import sys

import pytest

from deployments import callit
from tests.gateway.conftest import make_deployment, make_key

pytestmark = pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="the curl snippet is shell text")


def _run(argv, key: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env.update({"OPENAI_API_KEY": key} if key else {})
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


def test_the_curl_and_python_snippets_answer_with_a_key_and_are_refused_without(node, sched, gateway):
    node.gateway_port = gateway.gateway.port
    node.save()
    d = make_deployment(node, sched.port, served="acme/tiny-chat")
    key = make_key()
    gateway.reload()
    call = callit.call(d)
    assert call["base_url"] == f"{gateway.url}/v1" and call["models"] == ["acme/tiny-chat"]

    answer = _run(["bash", "-c", call["curl"] + " --silent --show-error"], key)
    assert answer.returncode == 0, answer.stderr
    reply = json.loads(answer.stdout)
    assert reply["model"] == "acme/tiny-chat" and reply["choices"][0]["message"]["content"]
    refused = _run(["bash", "-c", call["curl"] + " --silent"], "vcp-not-a-key")
    assert json.loads(refused.stdout)["error"]["code"] == "invalid_api_key", refused.stdout

    printed = _run([sys.executable, "-c", call["python"]], key)
    assert printed.returncode == 0 and printed.stdout.strip(), printed.stderr
    wrong = _run([sys.executable, "-c", call["python"]], "vcp-not-a-key")
    assert wrong.returncode != 0 and "AuthenticationError" in wrong.stderr, wrong.stderr
