"""An engine sees an allowlisted environment: never the panel's settings or secrets.

The launch test starts a real process through processes.launch (the same call that starts vLLM) with
the agent's environment full of panel secrets, and reads what the child process saw."""
import json
import os
import sys
from unittest import mock

from deployments.host import processenv, processes
from tests.conftest import wait_until

PANEL_SECRETS = {"DATABASE_URL": "postgres://panel:db-secret@db/panel", "REDIS_URL": "redis://:redis-secret@r:6379/0",
                 "SECRET_KEY": "django-secret-key-value", "HF_TOKEN": "hf_secret_token_value",
                 "PANEL_ADMIN_PASSWORD": "admin-secret-pw", "DJANGO_SETTINGS_MODULE": "controlpanel.settings",
                 "PANEL_VAR_DIR": "/srv/panel/var", "MODEL_STORE": "/models", "CELERY_LOG_FILE": "/x",
                 "HF_ENDPOINT": "http://mirror.internal", "VLLM_BIN": "/opt/vllm/bin/vllm", "AWS_SECRET_ACCESS_KEY": "aws-s"}


def test_the_engine_environment_keeps_what_a_process_needs_and_drops_the_panels_settings():
    agent = {"PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
             "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64", **PANEL_SECRETS}
    env = processenv.engine_environ({"VLLM_CPU_KVCACHE_SPACE": "1", "CUDA_VISIBLE_DEVICES": "0,1",
                                    "PANEL_DEPLOYMENT_OWNER": "12:nonce"}, agent)
    assert not set(PANEL_SECRETS) & set(env)
    assert {"PATH", "HOME", "LANG", "LC_ALL", "LD_LIBRARY_PATH"} <= set(env)
    # What the panel sets for the engine (deployment env, GPUs, its own ownership marker) passes.
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["PANEL_DEPLOYMENT_OWNER"] == "12:nonce" and env["HF_HUB_OFFLINE"] == "1"


def test_a_host_admin_may_let_more_names_through():
    with mock.patch.dict(os.environ, {"ENGINE_ENV_PASSTHROUGH": "MY_PROXY_CA", "MY_PROXY_CA": "/etc/ca.pem"}):
        assert processenv.engine_environ({})["MY_PROXY_CA"] == "/etc/ca.pem"
    assert "MY_PROXY_CA" not in processenv.engine_environ({}, {"MY_PROXY_CA": "/etc/ca.pem"})


def test_a_launched_engine_process_sees_none_of_the_agents_secrets(tmp_path):
    log = tmp_path / "engine.log"
    script = "import json, os; print(json.dumps(dict(os.environ)), flush=True)"
    with mock.patch.dict(os.environ, PANEL_SECRETS):
        handle = processes.launch(processes.EngineSpec(argv=[sys.executable, "-c", script], env={"VLLM_X": "1"}, log_path=log))
    wait_until(lambda: not processes.alive(handle.pid), message="the process to exit")
    seen = json.loads(log.read_text().strip().splitlines()[-1])
    assert seen["VLLM_X"] == "1" and "PATH" in seen
    leaked = {k for k, v in PANEL_SECRETS.items() if k in seen or any(v in value for value in seen.values())}
    assert not leaked, f"the engine saw {sorted(leaked)}"


def test_an_engine_follows_no_media_redirect_unless_an_admin_allows_it():
    """The gateway checks the media URL a caller sent against the route's domains, not where it redirects to (the
    cloud's metadata address, a host on the GPU node's network): engines get VLLM_MEDIA_URL_ALLOW_REDIRECTS=0."""
    from deployments import flagpolicy, privileged
    from plumbing.errors import ServiceError

    assert processenv.deployment_env({}, [0])["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0"
    assert processenv.deployment_env({"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1"})["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "1"
    assert "VLLM_MEDIA_URL_ALLOW_REDIRECTS" not in flagpolicy.OPERATOR_ENV
    try:
        privileged.check(engine_args={}, env={"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1"}, model_dir="/m", admin=False)
    except ServiceError as exc:
        assert exc.code == "forbidden" and "VLLM_MEDIA_URL_ALLOW_REDIRECTS" in exc.message
    else:
        raise AssertionError("an operator turned media redirects back on")
    privileged.check(engine_args={}, env={"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "1"}, model_dir="/m", admin=True)
