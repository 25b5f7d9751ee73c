"""A Docker Engine API double: the real HTTP API over a unix socket, for the part the `docker` SDK calls when
the panel runs engines as containers (deployments/host/containers.py) and a test restarts an agent container.

    python tests/dockerd.py --socket /tmp/x/docker.sock      (tests/faults/test_agent_restart.py starts it)

Endpoints (with or without the /v1.NN prefix): GET /_ping, GET /version, POST /containers/create,
POST /containers/{id}/start|stop|restart|kill|wait (HostConfig.RestartPolicy followed as Docker does: "always" and
"unless-stopped" start a container again after its process exits unless the API stopped or killed it, "on-failure"
after a non-zero code; refused with AutoRemove), POST /containers/{id}/update (RestartPolicy; refused on an AutoRemove
container, with Docker's words), GET /containers/json (all, filters: label, name, id, status),
GET /containers/{id}/json, GET /containers/{id}/logs (the multiplexed stream format), DELETE /containers/{id}.
Errors are Docker's: {"message": ...} with 404 (no such container), 409 (name in use, removing a running one),
304 (start a running one, stop a stopped one).

Each "container" is a real host process (Entrypoint + Cmd, Env, WorkingDir, User), a child of this daemon and so
outside any client's process tree, in a cgroup of its own where cgroup v2 is writable here (else its session and
descendants stand for it). As with containerd: when the main process exits, whatever is left in the container
is killed; `stop` sends the StopSignal (SIGTERM), waits t seconds, then SIGKILLs the whole container; AutoRemove
removes it once it has exited. Images are not real: any name runs the command on this host.

The daemon keeps its containers in its state folder, as Docker keeps /var/lib/docker: stopped (its containers killed,
as at a shutdown) and started again on the same folder (`Running.reboot`), it starts those whose policy says so,
"always", and "unless-stopped" unless the API stopped them.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import re
import secrets
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from aiohttp import web

API_VERSION = "1.45"
CGROUP_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _cgroup_root() -> Path | None:
    """A writable cgroup v2 hierarchy to put containers in, or None."""
    for root in CGROUP_ROOTS:
        if (root / "cgroup.procs").exists() and (root / "cgroup.subtree_control").exists():
            probe = root / f"dockerd-double-probe-{os.getpid()}"
            try:
                probe.mkdir()
                probe.rmdir()
                return root
            except OSError:
                continue
    return None


class Container:
    def __init__(self, cid: str, name: str, body: dict, cgroups: Path | None, logs: Path):
        self.id, self.name, self.body = cid, name, body
        self.host = body.setdefault("HostConfig", {})
        self.created = _now()
        self.proc: subprocess.Popen | None = None
        self.exit_code = 0
        self.started_at = self.finished_at = "0001-01-01T00:00:00Z"
        self.cgroup = cgroups / f"docker-{cid}.scope" if cgroups else None  # as Docker's systemd cgroup driver names it
        self.out, self.err = logs / f"{cid}.out", logs / f"{cid}.err"
        self.exited = threading.Event()
        self.exited.set()
        self.removed = False
        self.restart_count = 0
        self.stopped = False  # by the API (stop, kill): a restart policy brings it back only at the daemon's start
        self.restarting = False  # exited, its restart policy about to start it again (Docker's "restarting")

    def restart_due(self) -> bool:
        """Docker's restart policy, after an exit: "always" and "unless-stopped" unless stopped through the API,
        "on-failure" after a non-zero exit code."""
        policy = (self.host.get("RestartPolicy") or {}).get("Name") or "no"
        if self.stopped or self.removed:
            return False
        return policy in ("always", "unless-stopped") or (policy == "on-failure" and self.exit_code != 0)

    @property
    def running(self) -> bool:
        return self.proc is not None and not self.exited.is_set()

    def argv(self) -> list[str]:
        return list(self.body.get("Entrypoint") or []) + list(self.body.get("Cmd") or [])

    def start(self, on_exit) -> None:
        env = dict(item.split("=", 1) for item in self.body.get("Env") or [] if "=" in item)
        env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        env["HOSTNAME"] = self.id[:12]
        user = str(self.body.get("User") or "")
        uid, _, gid = user.partition(":")
        if self.cgroup:
            self.cgroup.mkdir(exist_ok=True)
        procs = str(self.cgroup / "cgroup.procs") if self.cgroup else None

        def enter_cgroup():  # in the child, before exec: everything it starts stays in the container
            if procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))

        self.exited.clear()
        with open(self.out, "ab") as out, open(self.err, "ab") as err:
            self.proc = subprocess.Popen(self.argv(), env=env, cwd=self.body.get("WorkingDir") or "/",
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                         preexec_fn=enter_cgroup, user=int(uid) if uid else None,
                                         group=int(gid) if gid else None)
        self.started_at = _now()
        threading.Thread(target=self._wait, args=(on_exit,), daemon=True).start()

    def _wait(self, on_exit) -> None:
        proc = self.proc
        code = proc.wait()
        self.kill_all()  # containerd: the main process gone, nothing of the container outlives it
        self.exit_code = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as Docker reports
        self.finished_at = _now()
        self.exited.set()
        on_exit(self)

    def members(self) -> list[int]:
        if self.cgroup:
            try:
                return [int(p) for p in (self.cgroup / "cgroup.procs").read_text().split()]
            except OSError:
                return []
        if self.proc is None:
            return []
        found = set()
        try:  # without cgroups: the main process's session and its descendants stand for the container
            main = psutil.Process(self.proc.pid)
            found |= {p.pid for p in main.children(recursive=True)}
        except psutil.Error:
            pass
        for pid in psutil.pids():
            try:
                if os.getsid(pid) == self.proc.pid:
                    found.add(pid)
            except OSError:
                continue
        return sorted(found)

    def signal_main(self, sig: int) -> None:
        if self.running:
            try:
                os.kill(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill_all(self) -> None:
        for _ in range(50):
            left = [pid for pid in self.members() if pid != os.getpid()]
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)

    def stop(self, timeout: float) -> None:
        self.stopped = True
        sig = signal.Signals[self.body.get("StopSignal") or "SIGTERM"] if not str(
            self.body.get("StopSignal") or "").isdigit() else int(self.body["StopSignal"])
        self.signal_main(sig)
        if not self.exited.wait(timeout):
            self.kill_all()
            self.signal_main(signal.SIGKILL)
            self.exited.wait(10)

    def cleanup(self) -> None:
        if self.cgroup and self.cgroup.exists():
            self.kill_all()
            try:
                self.cgroup.rmdir()
            except OSError:
                pass

    def status(self) -> str:
        if self.running:
            return "running"
        if self.restarting:
            return "restarting"
        return "created" if self.proc is None and self.started_at.startswith("0001") else "exited"

    def inspect(self) -> dict:
        return {
            "Id": self.id, "Name": f"/{self.name}", "Created": self.created, "Path": (self.argv() or [""])[0],
            "Args": self.argv()[1:], "Image": "sha256:" + "0" * 64, "RestartCount": self.restart_count,
            "State": {"Status": self.status(), "Running": self.running, "Paused": False, "Restarting": self.restarting,
                      "OOMKilled": False, "Dead": False, "Pid": self.proc.pid if self.running else 0,
                      "ExitCode": self.exit_code, "Error": "", "StartedAt": self.started_at, "FinishedAt": self.finished_at},
            "Config": {"Image": self.body.get("Image", ""), "Cmd": self.body.get("Cmd"), "Entrypoint": self.body.get("Entrypoint"),
                       "Env": self.body.get("Env") or [], "Labels": self.body.get("Labels") or {},
                       "WorkingDir": self.body.get("WorkingDir") or "", "User": self.body.get("User") or "",
                       "Tty": False, "OpenStdin": False, "AttachStdout": False, "AttachStderr": False},
            "HostConfig": self.host,
            "Mounts": [{"Type": "bind", "Source": b.split(":")[0], "Destination": b.split(":")[1],
                        "RW": not b.endswith(":ro")} for b in self.host.get("Binds") or []],
        }

    def summary(self) -> dict:
        return {"Id": self.id, "Names": [f"/{self.name}"], "Image": self.body.get("Image", ""), "ImageID": "sha256:" + "0" * 64,
                "Command": " ".join(self.argv()), "Created": int(time.time()), "Labels": self.body.get("Labels") or {},
                "State": self.status(), "Status": "Up" if self.running else f"Exited ({self.exit_code})"}


class Daemon:
    def __init__(self, state_dir: Path):
        self.containers: dict[str, Container] = {}
        self.cgroups = None
        root = _cgroup_root()
        if root:
            self.cgroups = root / f"dockerd-double-{os.getpid()}"
            self.cgroups.mkdir(exist_ok=True)
        self.logs = state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.state, self.closing, self.saving = state_dir / "containers.json", False, threading.Lock()

    def get(self, ref: str) -> Container:
        with self.lock:
            for c in self.containers.values():
                if ref in (c.id, c.name) or (len(ref) >= 12 and c.id.startswith(ref)):
                    return c
        raise web.HTTPNotFound(text=json.dumps({"message": f"No such container: {ref}"}), content_type="application/json")

    def on_exit(self, c: Container) -> None:
        if self.closing:
            return
        if c.host.get("AutoRemove"):
            self.remove(c)
        elif c.restart_due():
            c.restarting = True
            time.sleep(0.1)  # Docker's first restart delay
            c.restarting = False
            if c.restart_due() and not self.closing:
                c.restart_count += 1
                c.start(self.on_exit)
        self.save()

    def save(self) -> None:
        """The containers as Docker keeps them on disk: what a start of the daemon on this folder finds."""
        with self.lock:
            state = [{"id": c.id, "name": c.name, "body": c.body, "stopped": c.stopped, "exit_code": c.exit_code,
                      "restart_count": c.restart_count, "created": c.created, "started_at": c.started_at,
                      "finished_at": c.finished_at} for c in self.containers.values()]
        with self.saving:  # an exit (its thread) and a request may save at once
            tmp = self.state.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            tmp.replace(self.state)

    def load(self) -> None:
        """The containers a previous run of the daemon left (their processes died with it), then those their restart
        policy starts at the daemon's start: "always", and "unless-stopped" unless the API had stopped them."""
        if not self.state.exists():
            return
        for saved in json.loads(self.state.read_text()):
            c = Container(saved["id"], saved["name"], saved["body"], self.cgroups, self.logs)
            c.stopped, c.exit_code, c.restart_count = saved["stopped"], saved["exit_code"], saved["restart_count"]
            c.created, c.started_at, c.finished_at = saved["created"], saved["started_at"], saved["finished_at"]
            self.containers[c.id] = c
        for c in list(self.containers.values()):
            policy = (c.host.get("RestartPolicy") or {}).get("Name") or "no"
            if policy == "always" or (policy == "unless-stopped" and not c.stopped):
                c.start(self.on_exit)
        self.save()

    def remove(self, c: Container) -> None:
        with self.lock:
            self.containers.pop(c.id, None)
        c.removed = True
        c.cleanup()
        self.save()

    def shutdown(self) -> None:
        """As at a host's shutdown: every container killed; none counts as stopped through the API."""
        self.closing = True
        self.save()
        for c in list(self.containers.values()):
            c.kill_all()
            c.signal_main(signal.SIGKILL)
            c.exited.wait(5)
            c.cleanup()
        if self.cgroups:
            try:
                self.cgroups.rmdir()
            except OSError:
                pass


class Routes:
    def __init__(self):
        self.table: list[tuple[str, str, object]] = []

    def _add(self, method: str, path: str):
        def register(handler):
            self.table.append((method, path, handler))
            return handler
        return register

    def get(self, path):
        return self._add("GET", path)

    def post(self, path):
        return self._add("POST", path)

    def delete(self, path):
        return self._add("DELETE", path)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"message": message}, status=status)


def _matches(c: Container, filters: dict) -> bool:
    labels = c.body.get("Labels") or {}
    for want in filters.get("label", []):
        key, eq, value = want.partition("=")
        if key not in labels or (eq and labels[key] != value):
            return False
    if filters.get("name") and not any(re.search(n.lstrip("/"), c.name) for n in filters["name"]):
        return False
    if filters.get("id") and not any(c.id.startswith(i) for i in filters["id"]):
        return False
    if filters.get("status") and c.status() not in filters["status"]:
        return False
    return True


def app(daemon: Daemon) -> web.Application:
    routes = Routes()

    @routes.get("/_ping")
    async def ping(request):
        return web.Response(text="OK", headers={"Api-Version": API_VERSION, "Docker-Experimental": "false"})

    @routes.get("/version")
    async def version(request):
        return web.json_response({"Version": "27.0.0-double", "ApiVersion": API_VERSION, "MinAPIVersion": "1.24",
                                  "Os": "linux", "Arch": "amd64", "KernelVersion": os.uname().release,
                                  "Components": [{"Name": "Engine", "Version": "27.0.0-double"}]})

    @routes.post("/containers/create")
    async def create(request):
        body = await request.json()
        name = request.query.get("name") or f"double_{secrets.token_hex(4)}"
        if not body.get("Image"):
            return _error(400, "config cannot be empty in order to create a container")
        host = body.get("HostConfig") or {}
        if host.get("AutoRemove") and (host.get("RestartPolicy") or {}).get("Name") not in (None, "", "no"):
            return _error(400, "can't create 'AutoRemove' container with restart policy")
        with daemon.lock:
            if any(c.name == name for c in daemon.containers.values()):
                return _error(409, f'Conflict. The container name "/{name}" is already in use.')
            cid = secrets.token_hex(32)
            daemon.containers[cid] = Container(cid, name, body, daemon.cgroups, daemon.logs)
        daemon.save()
        return web.json_response({"Id": cid, "Warnings": []}, status=201)

    @routes.post("/containers/{id}/start")
    async def start(request):
        c = daemon.get(request.match_info["id"])
        if c.running:
            return web.Response(status=304)
        c.stopped = False
        try:
            await asyncio.to_thread(c.start, daemon.on_exit)
        except OSError as exc:  # Docker: 400 "failed to create task ... exec: no such file"
            return _error(400, f"failed to create task for container: exec: {exc}")
        daemon.save()
        return web.Response(status=204)

    @routes.post("/containers/{id}/stop")
    async def stop(request):
        c = daemon.get(request.match_info["id"])
        if not c.running:
            return web.Response(status=304)
        await asyncio.to_thread(c.stop, float(request.query.get("t", c.body.get("StopTimeout") or 10)))
        daemon.save()
        return web.Response(status=204)

    @routes.post("/containers/{id}/update")
    async def update(request):
        c = daemon.get(request.match_info["id"])
        body = await request.json()
        policy = body.get("RestartPolicy")
        if policy and policy.get("Name") not in (None, "", "no") and c.host.get("AutoRemove"):
            return _error(400, f"Cannot update container {c.id}: Restart policy cannot be updated because AutoRemove "
                               "is enabled for the container")
        if policy is not None:
            c.host["RestartPolicy"] = {"Name": policy.get("Name") or "no",
                                       "MaximumRetryCount": policy.get("MaximumRetryCount") or 0}
        daemon.save()
        return web.json_response({"Warnings": []})

    @routes.post("/containers/{id}/restart")
    async def restart(request):
        c = daemon.get(request.match_info["id"])
        if c.running:
            await asyncio.to_thread(c.stop, float(request.query.get("t", c.body.get("StopTimeout") or 10)))
        await asyncio.to_thread(c.start, daemon.on_exit)
        return web.Response(status=204)

    @routes.post("/containers/{id}/kill")
    async def kill(request):
        c = daemon.get(request.match_info["id"])
        if not c.running:
            return _error(409, f"Cannot kill container: {c.id}: container is not running")
        name = request.query.get("signal", "SIGKILL")
        sig = int(name) if name.isdigit() else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
        c.stopped = c.stopped or sig in (signal.SIGKILL, signal.SIGTERM)  # a manual kill: no restart, as in Docker
        c.signal_main(sig)
        daemon.save()
        return web.Response(status=204)

    @routes.post("/containers/{id}/wait")
    async def wait(request):
        c = daemon.get(request.match_info["id"])
        await asyncio.to_thread(c.exited.wait)
        return web.json_response({"StatusCode": c.exit_code, "Error": None})

    @routes.delete("/containers/{id}")
    async def remove(request):
        c = daemon.get(request.match_info["id"])
        if c.running:
            if request.query.get("force") not in ("1", "true", "True"):
                return _error(409, f"You cannot remove a running container {c.id}. Stop the container before "
                                   "attempting removal or force remove")
            c.kill_all()
            c.signal_main(signal.SIGKILL)
            await asyncio.to_thread(c.exited.wait, 10)
        daemon.remove(c)
        return web.Response(status=204)

    @routes.get("/containers/json")
    async def listing(request):
        filters = json.loads(request.query.get("filters") or "{}")
        filters = {k: (list(v) if isinstance(v, (list, dict)) else [v]) for k, v in filters.items()}
        show_all = request.query.get("all") in ("1", "true", "True")
        with daemon.lock:
            found = [c for c in daemon.containers.values() if (show_all or c.running) and _matches(c, filters)]
        return web.json_response([c.summary() for c in found])

    @routes.get("/containers/{id}/json")
    async def inspect(request):
        return web.json_response(daemon.get(request.match_info["id"]).inspect())

    @routes.get("/containers/{id}/logs")
    async def logs(request):
        c = daemon.get(request.match_info["id"])
        frames = b""
        for stream, path, wanted in ((1, c.out, request.query.get("stdout")), (2, c.err, request.query.get("stderr"))):
            if wanted in ("1", "true", "True") and path.exists():
                lines = path.read_bytes().splitlines(keepends=True)
                tail = request.query.get("tail", "all")
                if tail != "all":
                    lines = lines[-int(tail):] if int(tail) else []
                frames += b"".join(struct.pack(">BxxxL", stream, len(line)) + line for line in lines)
        return web.Response(body=frames, content_type="application/vnd.docker.raw-stream")

    application = web.Application()
    for method, path, handler in routes.table:  # Docker serves every route with and without /vN.NN
        application.router.add_route(method, path, handler)
        application.router.add_route(method, "/v{api_version:[0-9.]+}" + path, handler)
    return application


class Running:
    """This double as a daemon process of its own (its containers are its children, not the caller's); `host` is
    the DOCKER_HOST that reaches it."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.sock = folder, folder / "docker.sock"
        self.host = f"unix://{self.sock}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        import docker

        with open(self.folder / "dockerd.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, __file__, "--socket", str(self.sock)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while True:
            try:
                docker.DockerClient(base_url=self.host, version=API_VERSION, timeout=2).ping()
                return
            except Exception:  # noqa: BLE001 - not listening yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the Docker API double did not start: "
                                       f"{(self.folder / 'dockerd.log').read_text()[-2000:]}")
                time.sleep(0.1)

    def stop(self) -> None:
        """As at a host's shutdown: the daemon goes and every container with it (none counts as stopped by the API)."""
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def reboot(self) -> None:
        """The host's power cycle as Docker lives it: every container killed, then the daemon started on the same
        state, which starts what the restart policies say."""
        self.stop()
        self.start()


@contextlib.contextmanager
def running(folder: Path, handle: bool = False):
    """The double for as long as the block lasts: yields the DOCKER_HOST to reach it (`handle`: the Running, to
    reboot it). Every container is killed at the end."""
    daemon = Running(folder)
    daemon.start()
    try:
        yield daemon if handle else daemon.host
    finally:
        daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--state-dir", default="")
    args = parser.parse_args()
    sock = Path(args.socket)
    daemon = Daemon(Path(args.state_dir) if args.state_dir else sock.parent / "dockerd-double")
    daemon.load()

    def on_term(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        web.run_app(app(daemon), path=str(sock), print=None, handle_signals=False)
    except KeyboardInterrupt:
        pass
    finally:
        daemon.shutdown()
        sock.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
