"""The README's first command: the whole panel on embedded defaults, and Ctrl-C leaves nothing."""
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.conftest import ROOT, free_port, wait_until
from tests.hfserver import serve


@pytest.fixture
def slow_hub(tmp_path):
    """A Hugging Face-compatible server with a 40 MB model sent at 2 MB/s: a download still running at Ctrl-C."""
    repo = tmp_path / "hub" / "acme" / "slow"
    repo.mkdir(parents=True)
    (repo / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')
    (repo / "model.safetensors").write_bytes(os.urandom(40 << 20))
    with serve(tmp_path / "hub", throttle_bps=2 << 20) as url:
        yield url


@pytest.mark.timeout(240)
def test_the_launcher_starts_everything_logs_in_and_stops_everything(tmp_path, slow_hub):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "PANEL_ADMIN_PASSWORD", "SECRET_KEY")}
    env.update(PANEL_VAR_DIR=str(tmp_path / "var"), PYTHONUNBUFFERED="1", NODE_NAME="launcher-node", HF_ENDPOINT=slow_hub)
    port, gateway_port = free_port(), free_port()
    log = open(tmp_path / "launcher.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "panelctl.launcher", "start", "--port", str(port),
                             "--gateway-port", str(gateway_port)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def banner():
            log.seek(0)
            return re.search(r"First admin:\s+(\S+)\s+/\s+(\S+)", log.read())

        match = wait_until(banner, timeout=120, interval=0.5, message="the launcher's banner")
        username, password = match.groups()
        log.seek(0)
        # The first admin's box is not buried under Celery's banners: the control worker and the node's start --quiet.
        assert "[config]" not in log.read()
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "uvicorn" in names and "celery" in names and "nodeagent" in names
        log.seek(0)
        assert "manage.py gateway --node launcher-node" in names and f"http://127.0.0.1:{gateway_port}/v1" in log.read()
        # Secrets at rest and at start: nothing world-readable, no password or key on a command line.
        var = tmp_path / "var"
        assert (var / "secret_key").stat().st_mode & 0o777 == 0o600
        assert (var / "panel.sqlite3").stat().st_mode & 0o077 == 0
        # var/ is the agent's: others nothing; the engine user's group at most enters it (to reach model folders)
        assert var.stat().st_mode & 0o067 == 0, oct(var.stat().st_mode)
        assert password not in names and (var / "secret_key").read_text().strip() not in names
        assert not any("PANEL_ADMIN_PASSWORD" in c.environ() or "SECRET_KEY" in c.environ() for c in children)

        with httpx.Client(base_url=f"http://127.0.0.1:{port}", follow_redirects=True) as http:
            login = http.get("/accounts/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text).group(1)
            home = http.post("/accounts/login/", data={"username": username, "password": password,
                                                       "csrfmiddlewaretoken": token})
            assert home.url.path == "/" and "Fleet" in home.text
            nodes = wait_until(lambda: http.get("/api/nodes/").json()["results"], timeout=60, message="the local node")
            assert nodes[0]["name"] == "launcher-node" and nodes[0]["online"]
            # Pages give callers the gateway at the node's address: where it listens (loopback here).
            assert nodes[0]["address"] == "127.0.0.1"
            # The node's gateway answers, and refuses a call without a key.
            assert wait_until(lambda: httpx.get(f"http://127.0.0.1:{gateway_port}/healthz").status_code == 200,
                              timeout=30, message="the gateway")
            assert httpx.post(f"http://127.0.0.1:{gateway_port}/v1/chat/completions", json={}).status_code == 401

            # A download still running when Ctrl-C comes (the first hour's case): no traceback at the stop.
            def csrf(path):
                return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', http.get(path).text).group(1)

            added = http.post("/models/add/", data={"repo_id": "acme/slow", "revision": "main",
                                                    "csrfmiddlewaretoken": csrf("/models/")})
            model_path = added.url.path
            wait_until(lambda: http.get(f"/api{model_path}").json()["total_size"] > 0, timeout=60,
                       message="the model read from the hub")
            http.post(f"{model_path}download/", data={"node": nodes[0]["id"], "csrfmiddlewaretoken": csrf(model_path)})
            wait_until(lambda: any(c["state"] == "downloading" and c["bytes_done"] > 0
                                   for c in http.get(f"/api{model_path}").json()["copies"]), timeout=60, message="the download")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    time.sleep(0.5)
    assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
    log.seek(0)
    output = log.read()
    assert "Stopping" in output and "Traceback" not in output, output[output.find("Stopping"):][:4000]
    # The first admin's box comes after every Celery start-up banner, not buried under them.
    assert output.rfind("[queues]") < output.find("First admin"), output[:6000]


def test_a_second_start_does_not_print_a_new_password(tmp_path):
    from panelctl import launcher

    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env["PANEL_VAR_DIR"] = str(tmp_path)
    launcher.manage("migrate", "--noinput", "-v", "0", env=env)
    assert launcher.ensure_admin(env)[1]
    assert launcher.ensure_admin(env)[1] is None


def test_panel_test_hands_every_argument_to_pytest_leading_options_included(tmp_path):
    # `./panel test -x -k EXPR --lf ...`: options come first, as a developer types them. Collection only,
    # so the run needs no Redis (REDIS_URL set keeps the launcher from starting one).
    env = {**os.environ, "REDIS_URL": "redis://127.0.0.1:9/0"}
    argv = [sys.executable, "-m", "panelctl.launcher", "test", "-x", "-k", "second_start", "--lf",
            "-o", f"cache_dir={tmp_path}", "--collect-only", "-q", "tests/integration/test_launcher.py"]
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test_a_second_start_does_not_print_a_new_password" in run.stdout
    assert "test_the_launcher_starts_everything" not in run.stdout  # -k deselected it
    assert "deselected" in run.stdout


def test_a_weak_first_admin_password_is_refused_with_the_validators_reasons(tmp_path):
    from panelctl import launcher

    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update(PANEL_VAR_DIR=str(tmp_path), PANEL_ADMIN_USER="admin", PANEL_ADMIN_PASSWORD="admin")
    launcher.manage("migrate", "--noinput", "-v", "0", env=env)
    with pytest.raises(SystemExit, match="PANEL_ADMIN_PASSWORD is too weak: .*too short"):
        launcher.ensure_admin(env)
    env["PANEL_ADMIN_PASSWORD"] = "a-long-enough-phrase-for-an-admin"
    assert launcher.ensure_admin(env)[1] == "a-long-enough-phrase-for-an-admin"
