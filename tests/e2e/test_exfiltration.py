"""The exfiltration attack, end to end: a model whose remote code looks for the panel's secrets everywhere
it can (its own environment, every /proc/*/environ and /proc/*/cmdline it can open, the panel's var/ folder,
the agent's home) and signals the agent is deployed with --trust-remote-code by a real node agent on the
real CPU vLLM engine, while the agent's own environment holds the panel's settings and secrets. The engine
runs as its own user (vllm-engine): it finds none of them, and the signal fails with EPERM; what
the panel sets for it (its ownership marker, the offline switches, its engine key as VLLM_API_KEY) it
does see."""
import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from deployments import engineapikey
from deployments.host import osuser, ownership, processes
from deployments.models import Deployment, Node
from deployments.services import deploys
from tests.conftest import free_port, in_thread, wait_until
from tests.e2e.conftest import start_cpu_node
from tests.factories import UserFactory

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
MARK = "ENGINE-ENV "
SPY = '''
import json, os, sys
from transformers import LlamaConfig
# Runs when the engine loads the model's config with --trust-remote-code: exactly what an attacker's repo does.
OUT, SCAN = {out!r}, {scan!r}


def read(path, limit=1 << 16):
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return None


def scan():
    found = {{"pid": os.getpid(), "uid": os.getuid(), "status": read("/proc/self/status"), "environ": {{}},
             "cmdline": {{}}, "files": {{}}, "denied": [], "kill": {{}}}}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for what in ("environ", "cmdline"):
            text = read(f"/proc/{{pid}}/{{what}}")
            if text is not None:
                found[what][pid] = text
    for top in SCAN:
        for dirpath, dirnames, filenames in os.walk(top, onerror=lambda e: found["denied"].append(e.filename)):
            for name in filenames:
                text = read(os.path.join(dirpath, name))
                if text is not None:
                    found["files"][os.path.join(dirpath, name)] = text
    pid = os.getppid()
    while pid > 1:  # every ancestor: the engine's parent (or grandparent) is the agent
        try:
            os.kill(pid, 0)
            found["kill"][pid] = 0
        except OSError as exc:
            found["kill"][pid] = exc.errno
        pid = int(read(f"/proc/{{pid}}/stat").rsplit(")", 1)[1].split()[1])
    with open(os.path.join(OUT, f"scan-{{os.getpid()}}.json"), "w") as f:
        json.dump(found, f)


print({mark!r} + json.dumps(dict(os.environ)), file=sys.stderr, flush=True)
scan()


class SpyConfig(LlamaConfig):
    model_type = "llama"
'''
AGENT_SECRETS = {"PANEL_ADMIN_PASSWORD": "admin-pw-exfil-1", "HF_TOKEN": "hf_exfil_token_1",
                 "AWS_SECRET_ACCESS_KEY": "aws-exfil-1", "METRICS_TOKEN": "metrics-exfil-1"}


@pytest.fixture
def exfil_dir():
    """Outside pytest's 0700 folders: the spy model, which the engine user must read, and the spy's reports."""
    base = Path(tempfile.mkdtemp(prefix="exfil-"))
    base.chmod(0o755)
    (base / "out").mkdir()
    (base / "out").chmod(0o1777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _spy_model(tiny_model, base: Path, scan: list[str]) -> Path:
    folder = base / "spy-model"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_spy.SpyConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_spy.py").write_text(SPY.format(out=str(base / "out"), scan=scan, mark=MARK))
    for path in (folder, *folder.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return folder


@pytest.mark.skipif(os.geteuid() != 0, reason="engines run as their own user only under a root agent")
def test_remote_code_in_a_deployed_model_finds_none_of_the_panels_secrets(process_env, spawn, unique, tmp_path,
                                                                          tiny_model, exfil_dir):
    agent_home = os.path.expanduser("~")
    spy_model = _spy_model(tiny_model, exfil_dir, [str(tmp_path), agent_home])  # tmp_path is the agent's var/
    node, model, agent_env = start_cpu_node(process_env, spawn, unique, tmp_path, spy_model,
                                            HF_HOME=str(tmp_path / "hf"), **AGENT_SECRETS)
    user = osuser.resolve(make=False)
    assert user.separate and user.uid != 0
    assert Node.objects.get(pk=node.pk).engine_user["describe"] == f"{user.name} (uid {user.uid})"
    admin = UserFactory(is_superuser=True)
    d = in_thread(deploys.deployment_create, model=model, node=node, gpu_indices=[], port=free_port(),
                  engine_args={"trust-remote-code": True, "enforce-eager": True, "max-model-len": 512, "max-num-seqs": 4},
                  env={"VLLM_CPU_KVCACHE_SPACE": "1"}, user=admin)
    try:
        log_path = wait_until(lambda: Deployment.objects.get(pk=d.pk).log_path, timeout=120, message="the engine's log")
        api_key = engineapikey.of(Deployment.objects.get(pk=d.pk))  # made by the plan before the launch

        def seen():
            try:
                with open(log_path, errors="replace") as log:
                    return [json.loads(line.split(MARK, 1)[1]) for line in log if MARK in line]
            except FileNotFoundError:  # the plan names the log before the engine writes it
                return []

        environments = wait_until(seen, timeout=300, interval=0.5, message="the remote code to run in the engine")
        scans = wait_until(lambda: [json.loads(p.read_text()) for p in (exfil_dir / "out").glob("scan-*.json")],
                           timeout=60, message="the spy's scan")
        engine_pid = Deployment.objects.get(pk=d.pk).pid
        status = dict(line.split(":", 1) for line in Path(f"/proc/{engine_pid}/status").read_text().splitlines())
        cmdline = Path(f"/proc/{engine_pid}/cmdline").read_bytes().decode()
    finally:
        pgid = Deployment.objects.get(pk=d.pk).pgid
        if pgid:
            processes.stop(pgid, term_timeout_s=5, kill_timeout_s=5)
    # The engine's own process: the engine user, no_new_privs, and no key on its command line (`ps`).
    assert status["Uid"].split()[:2] == [str(user.uid)] * 2 and status["NoNewPrivs"].strip() == "1"
    assert api_key and api_key not in cmdline and "--api-key" not in cmdline and "spy-model" in cmdline
    secrets = {k: v for k, v in agent_env.items()
               if k in AGENT_SECRETS or k in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "SECRET_KEY_FILE",
                                              "DJANGO_SETTINGS_MODULE", "PANEL_VAR_DIR", "VLLM_BIN", "MODEL_STORE")}
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "PANEL_ADMIN_PASSWORD", "HF_TOKEN"} <= set(secrets)
    values = {k: v for k, v in secrets.items() if k not in ("PANEL_VAR_DIR", "DJANGO_SETTINGS_MODULE")}  # folders: by name
    for env in environments:
        leaked = sorted({k for k in secrets if k in env} | {k for k, v in values.items() if any(v in x for x in env.values())})
        assert not leaked, f"the engine's remote code read {leaked}"
        assert env[ownership.MARKER_VAR].startswith(f"{d.pk}.") and env["HF_HUB_OFFLINE"] == "1"
        assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "PATH" in env and env["VLLM_API_KEY"] == api_key
        assert env["HOME"] == user.home
    # Everything else it could open: other processes' environments and command lines, var/, the agent's home.
    hidden = {k: v for k, v in agent_env.items() if k in AGENT_SECRETS or k in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")}
    for found in scans:
        assert found["uid"] == user.uid and "NoNewPrivs:\t1" in found["status"]
        places = {f"/proc/{pid}/environ": text for pid, text in found["environ"].items()}
        places |= {f"/proc/{pid}/cmdline": text for pid, text in found["cmdline"].items()}
        places |= found["files"]
        leaks = sorted(f"{k} in {where}" for where, text in places.items() for k, v in hidden.items() if v in text)
        assert not leaks, f"the engine's remote code found {leaks}"
        assert not any(api_key in text for where, text in places.items() if where.endswith("/cmdline"))
        assert str(node.agent_pid) not in found["environ"]  # the agent's environment: not its to open
        assert found["kill"].get(str(node.agent_pid)) == errno.EPERM, found["kill"]
        assert not any(path.startswith((str(tmp_path), agent_home)) for path in found["files"]), sorted(found["files"])[:5]
    assert stat.S_IMODE(tmp_path.stat().st_mode) & 0o007 == 0  # the agent closed its var/ to other users
