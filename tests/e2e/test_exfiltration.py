"""The environment-exfiltration attack, end to end: a model whose remote code writes the engine's
whole environment to its log is deployed with --trust-remote-code by a real node agent on the real
CPU vLLM engine, while the agent's own environment holds the panel's settings and secrets. None of
them may reach the engine; what the panel sets for it (its ownership marker, the offline switches) does."""
import json
import shutil

import pytest

from deployments.host import engine, ownership
from deployments.models import Deployment
from deployments.services import deploys
from tests.conftest import in_thread, wait_until
from tests.e2e.conftest import start_cpu_node
from tests.factories import UserFactory

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
MARK = "ENGINE-ENV "
SPY = f'''
import json, os, sys
from transformers import LlamaConfig
# Runs when the engine loads the model's config with --trust-remote-code: exactly what an attacker's repo does.
print({MARK!r} + json.dumps(dict(os.environ)), file=sys.stderr, flush=True)


class SpyConfig(LlamaConfig):
    model_type = "llama"
'''
AGENT_SECRETS = {"PANEL_ADMIN_PASSWORD": "admin-pw-exfil-1", "HF_TOKEN": "hf_exfil_token_1",
                 "AWS_SECRET_ACCESS_KEY": "aws-exfil-1", "METRICS_TOKEN": "metrics-exfil-1"}


@pytest.fixture
def spy_model(tiny_model, tmp_path):
    folder = tmp_path / "spy-model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_spy.SpyConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_spy.py").write_text(SPY)
    return folder


def test_remote_code_in_a_deployed_model_sees_none_of_the_panels_settings(process_env, spawn, unique, tmp_path, spy_model):
    node, model, agent_env = start_cpu_node(process_env, spawn, unique, tmp_path, spy_model,
                                            HF_HOME=str(tmp_path / "hf"), **AGENT_SECRETS)
    admin = UserFactory(is_superuser=True)
    d = in_thread(deploys.deployment_create, model=model, node=node, gpu_indices=[], port=_free_port(),
                  engine_args={"trust-remote-code": True, "enforce-eager": True, "max-model-len": 512, "max-num-seqs": 4},
                  env={"VLLM_CPU_KVCACHE_SPACE": "1"}, user=admin)
    try:
        log_path = wait_until(lambda: Deployment.objects.get(pk=d.pk).log_path, timeout=120, message="the engine's log")

        def seen():
            try:
                with open(log_path, errors="replace") as log:
                    return [json.loads(line.split(MARK, 1)[1]) for line in log if MARK in line]
            except FileNotFoundError:  # the plan names the log before the engine writes it
                return []

        environments = wait_until(seen, timeout=300, interval=0.5, message="the remote code to run in the engine")
    finally:
        pgid = Deployment.objects.get(pk=d.pk).pgid
        if pgid:
            engine.stop(pgid, term_timeout_s=5, kill_timeout_s=5)
    secrets = {k: v for k, v in agent_env.items()
               if k in AGENT_SECRETS or k in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "SECRET_KEY_FILE",
                                              "DJANGO_SETTINGS_MODULE", "PANEL_VAR_DIR", "VLLM_BIN", "MODEL_STORE")}
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "PANEL_ADMIN_PASSWORD", "HF_TOKEN"} <= set(secrets)
    values = {k: v for k, v in secrets.items() if k not in ("PANEL_VAR_DIR", "DJANGO_SETTINGS_MODULE")}  # folders: by name
    for env in environments:
        leaked = sorted({k for k in secrets if k in env} | {k for k, v in values.items() if any(v in x for x in env.values())})
        assert not leaked, f"the engine's remote code read {leaked}"
        assert env[ownership.MARKER_VAR].startswith(f"{d.pk}.") and env["HF_HUB_OFFLINE"] == "1"
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "PATH" in env


def _free_port():
    from tests.conftest import free_port

    return free_port()
