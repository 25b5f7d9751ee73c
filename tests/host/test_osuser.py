"""Engines as their own user: the launch options, the unit text, and real processes started as
that user on this machine (it runs as root, so the switch is real). No vLLM, no database."""
import errno
import json
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.host import osuser, processenv, processes, systemd
from tests.conftest import wait_until

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
PY = "/usr/bin/python3"  # readable by every user, unlike a venv under a 0700 home


@pytest.fixture(scope="module")
def user():
    if os.geteuid() != 0:
        pytest.skip("switching users needs root")
    return osuser.resolve(osuser.DEFAULT_NAME)  # the install step's helper: created when missing


def test_the_argv_carries_no_api_key_and_the_environment_does():
    for argv in (["vllm", "serve", "/m", "--api-key", "sk-1", "--port", "8000"],
                 ["vllm", "serve", "/m", "--api-key=sk-1", "--port", "8000"],
                 ["vllm", "serve", "/m", "--port", "8000", "--api-key", "sk-1"]):
        out, env = processenv.secret_argv(argv)
        assert out == ["vllm", "serve", "/m", "--port", "8000"] and env == {"VLLM_API_KEY": "sk-1"}
    with pytest.raises(processenv.SecretFlagError, match="one value"):
        processenv.secret_argv(["vllm", "serve", "/m", "--api-key", "a", "b"])
    assert processenv.secret_argv(["vllm", "serve", "/m", "--enforce-eager"]) == (["vllm", "serve", "/m", "--enforce-eager"], {})


def test_the_launch_options_name_the_engine_user_its_groups_no_new_privs_and_its_own_home(user, tmp_path):
    spec = processes.EngineSpec(argv=["vllm", "serve", "/m", "--api-key", "sk-secret-2"], env={"A": "1"},
                             log_path=tmp_path / "l.log", cwd=Path("/"), run_as=user)
    args = processes.popen_args(spec)
    assert args["user"] == user.uid and args["group"] == user.gid and args["extra_groups"] == list(user.groups)
    assert args["args"][:2] == [osuser.argv_prefix()[0], "--no-new-privs"] or args["preexec_fn"] is osuser.no_new_privs
    assert "sk-secret-2" not in " ".join(args["args"]) and args["env"]["VLLM_API_KEY"] == "sk-secret-2"
    assert args["env"]["HOME"] == user.home and args["env"]["USER"] == user.name
    assert args["env"]["VLLM_CACHE_ROOT"].startswith(user.home + "/") and args["env"]["HF_HOME"].startswith(user.home + "/")
    assert pwd.getpwnam(user.name).pw_uid == user.uid != 0
    assert stat.S_IMODE(os.stat(user.home).st_mode) == 0o750 and os.stat(user.home).st_uid == user.uid


def test_the_agents_own_user_gets_no_switch():
    own = osuser.EngineUser(name="panel", uid=1000, gid=1000, separate=False, note="the agent is not root")
    assert own.popen_kwargs() == {} and own.environ() == {}
    assert own.describe() == "the agent's user, panel (uid 1000): the agent is not root"
    assert osuser.from_facts(own.facts()) == own


@needs_root
def test_a_launched_engine_runs_as_the_engine_user_and_cannot_reach_the_agent(user, tmp_path):
    secret = tmp_path / "secret_key"
    secret.write_text("agent-secret-3")
    secret.chmod(0o600)
    outside = Path("/tmp") / f"osuser-out-{os.getpid()}"  # somewhere the engine user may write
    outside.mkdir(mode=0o777, exist_ok=True)
    outside.chmod(0o777)
    probe = f"""
import json, os
def read(p):
    try:
        return open(p).read()
    except OSError as e:
        return e.errno
def kill(pid):
    try:
        os.kill(pid, 0); return 0
    except OSError as e:
        return e.errno
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
out = {{"uid": os.getuid(), "gid": os.getgid(), "nnp": status["NoNewPrivs"].strip(), "home": os.environ["HOME"],
       "key": os.environ.get("VLLM_API_KEY"), "cmdline": open("/proc/self/cmdline").read(),
       "secret": read({str(secret)!r}), "environ": read("/proc/{os.getpid()}/environ"), "kill": kill({os.getpid()})}}
open({str(outside / "probe.tmp")!r}, "w").write(json.dumps(out))
os.replace({str(outside / "probe.tmp")!r}, {str(outside / "probe.json")!r})  # whole, never half-written when read
"""
    try:
        handle = processes.launch(processes.EngineSpec(argv=[PY, "-c", probe, "--api-key", "sk-launch-4"], env={},
                                                 log_path=tmp_path / "engine.log", run_as=user))
        wait_until(lambda: (outside / "probe.json").exists(), timeout=30, message="the probe's report")
        seen = json.loads((outside / "probe.json").read_text())
    finally:
        subprocess.run(["rm", "-rf", str(outside)], check=False)
    assert handle.pid > 0 and (seen["uid"], seen["gid"], seen["nnp"]) == (user.uid, user.gid, "1")
    assert seen["home"] == user.home and seen["key"] == "sk-launch-4" and "sk-launch-4" not in seen["cmdline"]
    assert seen["secret"] == errno.EACCES and seen["environ"] == errno.EACCES and seen["kill"] == errno.EPERM
    log = tmp_path / "engine.log"
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and log.stat().st_uid == 0  # the agent's file, written through an fd


@needs_root
def test_a_launch_says_which_folder_the_engine_user_cannot_read(user, tmp_path):
    private = tmp_path / "model"
    private.mkdir(mode=0o700)
    spec = processes.EngineSpec(argv=[PY, "-c", "pass"], env={}, log_path=tmp_path / "l.log", cwd=private, run_as=user)
    with pytest.raises(processes.EngineError, match=f"{user.name} cannot read {private}"):
        processes.launch(spec)


@needs_root
def test_a_model_in_the_store_is_opened_to_the_engine_user_and_nothing_else_is(user, tmp_path):
    base = Path("/tmp") / f"osuser-store-{os.getpid()}"
    try:
        var = base / "var"
        model = var / "models" / "org" / "m"
        model.mkdir(parents=True)
        (model / "config.json").write_text("{}")
        (var / "secret_key").write_text("k")
        (var / "panel.sqlite3").write_text("db")
        (var / "logs").mkdir()
        for p in (base, var / "models", var / "models" / "org", model):
            p.chmod(0o755 if p == base else 0o700)
        (model / "config.json").chmod(0o600)
        (var / "panel.sqlite3").chmod(0o644)  # made world-readable by an older version
        osuser.protect(var, user)
        assert not osuser.can_reach(user, model / "config.json")
        changed = osuser.share(user, model, var / "models")
        assert str(model / "config.json") in changed and osuser.can_reach(user, model / "config.json")
        assert osuser.share(user, model, var / "models") == []  # the second launch changes nothing
        for private in (var / "secret_key", var / "panel.sqlite3", var / "logs"):
            assert not osuser.can_reach(user, private), private
        assert stat.S_IMODE(var.stat().st_mode) == 0o710 and var.stat().st_gid == user.gid
        assert stat.S_IMODE((var / "panel.sqlite3").stat().st_mode) == 0o600
        assert osuser.share(user, base / "elsewhere", var / "models") == []  # not in the store: untouched
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=False)


def test_the_unit_runs_as_the_engine_user_with_no_new_privs_and_the_key_in_its_environment_file(tmp_path):
    user = osuser.EngineUser(name="vllm-engine", uid=990, gid=990, groups=(44,), home="/var/lib/vllm-engine",
                                 group_names=("video",))
    argv, secret_env = systemd.secret_argv(["/opt/vllm", "serve", "/models/m", "--api-key", "sk-unit-5"])
    text = systemd.render_unit(description="vLLM m", argv=argv, env={"A": "1"}, log_path="/var/log/m.log", run_as=user,
                               secret_env_file="/etc/systemd/system/vllm-m.service.env")
    assert "User=vllm-engine\n" in text and "Group=990\n" in text and "SupplementaryGroups=video\n" in text
    assert "NoNewPrivileges=yes\n" in text and 'Environment="HOME=/var/lib/vllm-engine"' in text
    assert "sk-unit-5" not in text and secret_env == {"VLLM_API_KEY": "sk-unit-5"}
    assert "EnvironmentFile=/etc/systemd/system/vllm-m.service.env" in text
    root_text = systemd.render_unit(description="vLLM m", argv=argv, env={}, log_path="/l", run_as=None)
    assert "User=" not in root_text and "NoNewPrivileges=yes" in root_text


def test_device_groups_are_those_owning_gpu_nodes_with_group_access(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    node = tmp_path / "nvidia0"
    try:
        os.mknod(node, 0o660 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("this container may not make device nodes")
    os.chown(node, 0, 44)
    node.chmod(0o660)  # mknod's mode passes through the umask
    open_node = tmp_path / "nvidiactl"
    os.mknod(open_node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # root:root 0666, NVIDIA's default: no group needed
    assert osuser.device_groups((str(tmp_path / "nvidia*"),)) == {44}


def test_install_step_helper_prints_who_engines_run_as():
    out = subprocess.run([sys.executable, osuser.__file__, "show"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("engines run as ")


def test_the_node_image_makes_the_engine_user_compose_names():
    import yaml

    root = Path(__file__).resolve().parents[2]
    agent = yaml.safe_load((root / "docker-compose.yml").read_text())["services"]["nodeagent"]
    name = agent["environment"]["PANEL_ENGINE_USER"]
    dockerfile = (root / "Dockerfile.node").read_text()
    assert name == osuser.DEFAULT_NAME and f"useradd --system --uid ${{ENGINE_UID}} --gid {name}" in dockerfile
    assert f"PANEL_ENGINE_USER={name}" in dockerfile and "ARG ENGINE_UID=64050" in dockerfile
    assert "user" not in agent  # the agent stays root in its container: it switches each engine to that user
