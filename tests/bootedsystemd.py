"""A booted Debian container with a real systemd as its PID 1, for tests of what the panel asks of systemd (units,
reboots) on hosts where no systemd runs (see ../shared/FACTS.md, "A real systemd on these machines").

The root is Debian's debootstrap, built once per machine by scripts/systemd-root (`./panel test` runs it; cached
under /var/cache/vllm-controlpanel). Each Booted gets an overlay of it of its own (the cached root is never written:
units a test installs, the engine user it creates, live in the overlay's upper folder until close()), boots it with
`systemd-nspawn -b`, binding the folders the panel needs at their own paths (the checkout, its virtualenv, the
Python that runs it, the tests' temporary folder), and runs commands inside with `nsenter` into every namespace of
the container's PID 1. The container shares the host's network (the agent inside reaches the tests' Redis and
database) and its own /proc, /dev/shm and PID numbers: `ns_pid` turns a host PID into the container's.

reboot() is a real one: `systemctl poweroff` inside (systemd stops every unit, the kernel ends what is left of the
container's processes with its PID namespace), then a boot of the same root. close() always leaves nothing running.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "scripts" / "systemd-root"
UP = {"running", "degraded"}
# The cgroup hierarchies a container is placed in: the v2 one and systemd's named v1 one of a hybrid host, or the
# v2 root of a unified host.
HIERARCHIES = (
    Path("/sys/fs/cgroup/unified"),
    Path("/sys/fs/cgroup/systemd"),
    Path("/sys/fs/cgroup"),
)
TOOLS = ("systemd-nspawn", "nsenter", "debootstrap")


class BootError(Exception):
    pass


def missing() -> str:
    """Why a container cannot be booted here ("" when it can)."""
    if os.geteuid() != 0:
        return "booting a container needs root"
    absent = [t for t in TOOLS if shutil.which(t) is None]
    return (
        f"missing {', '.join(absent)} (Debian's systemd-container, util-linux, debootstrap)"
        if absent
        else ""
    )


def root_fs() -> Path:
    """The cached root (built on first use: scripts/systemd-root locks, builds aside and renames)."""
    out = subprocess.run(
        ["bash", str(BUILD)],
        capture_output=True,
        text=True,
        timeout=1800,
        stdin=subprocess.DEVNULL,
    )
    if out.returncode != 0:
        raise BootError(f"scripts/systemd-root failed: {out.stderr[-2000:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def panel_binds(*extra: str | Path) -> list[Path]:
    """What an agent of this checkout needs inside: the checkout, its virtualenv and the Python that runs it (unless
    under /usr, which the container has of its own), and `extra`; without a folder already inside another."""
    wanted = [
        ROOT,
        (ROOT / ".venv").resolve(),
        Path(sys.base_prefix).resolve(),
        *map(Path, extra),
    ]
    wanted = [
        p
        for p in wanted
        if p.exists() and not (p == Path("/usr") or Path("/usr") in p.parents)
    ]
    return [p for p in wanted if not any(o != p and o in p.parents for o in wanted)]


class Booted:
    """One container: an overlay of the cached root under `workdir`, booted by boot(), gone after close()."""

    def __init__(self, rootfs: Path, binds: list[Path], workdir: Path | None = None):
        self.binds = list(dict.fromkeys(binds))
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="booted-systemd-"))
        self.merged = self.workdir / "root"
        for sub in ("upper", "work", "root"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        mounted = subprocess.run(
            [
                "mount",
                "-t",
                "overlay",
                "overlay",
                "-o",
                f"lowerdir={rootfs},upperdir={self.workdir / 'upper'},workdir={self.workdir / 'work'}",
                str(self.merged),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if mounted.returncode != 0:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise BootError(f"cannot mount the overlay of {rootfs}: {mounted.stderr}")
        # A control group of its own in each hierarchy: nspawn (--keep-unit) puts the container's tree under the
        # group it runs in ("payload", "supervisor"), which for two containers started from one group would be one.
        self.cgroups = [
            h / self.workdir.name for h in HIERARCHIES if (h / "cgroup.procs").exists()
        ]
        self.proc: subprocess.Popen | None = None
        self.pid = 0  # the container's systemd, as the host numbers it
        self.boots = 0

    # --- boot, poweroff, reboot --------------------------------------------------------------------------------

    def boot(self, timeout: float = 120.0) -> float:
        """Boot and wait until `systemctl is-system-running` says running or degraded; return the seconds it took."""
        started = time.monotonic()
        log = open(self.workdir / f"console-{self.boots}.log", "wb")
        argv = [
            "systemd-nspawn",
            "-q",
            "--register=no",
            "--keep-unit",
            "-D",
            str(self.merged),
            "-b",
            *(f"--bind={p}" for p in self.binds),
        ]
        for group in self.cgroups:
            group.mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=self._enter_cgroups,
        )
        log.close()
        self.boots += 1
        self.pid = self._wait(self._pid1, timeout, "the container's systemd to start")
        state = self._wait(
            self._up,
            max(1.0, timeout - (time.monotonic() - started)),
            "the boot to finish",
        )
        if state not in UP:
            raise BootError(f"the container's systemd says {state!r}")
        return time.monotonic() - started

    def _enter_cgroups(self) -> None:
        for group in self.cgroups:
            (group / "cgroup.procs").write_text(str(os.getpid()))

    def _wait(self, probe, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BootError(
                    f"systemd-nspawn exited ({self.proc.returncode}) waiting for {what}: {self.console()}"
                )
            if found := probe():
                return found
            time.sleep(0.1)
        raise BootError(f"timed out waiting for {what}: {self.console()}")

    def _pid1(self) -> int:
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                if ns_chain(child.pid)[-1:] == [1]:
                    return child.pid
        except psutil.Error:
            pass
        return 0

    def _up(self) -> str:
        out = self.run(
            "systemctl", "is-system-running", check=False, timeout=30
        ).stdout.strip()
        return out if out in UP or out == "maintenance" else ""

    def console(self) -> str:
        logs = sorted(self.workdir.glob("console-*.log"))
        return logs[-1].read_text(errors="replace")[-3000:] if logs else ""

    def poweroff(self, timeout: float = 90.0) -> None:
        """`systemctl poweroff` inside; wait for the container to end (killed past `timeout`)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.run("systemctl", "poweroff", check=False, timeout=30)
                self.proc.wait(timeout)
            # Not booted yet (no systemd to ask), or it would not go: killed.
            except (BootError, subprocess.SubprocessError):
                self._kill()
        self.proc, self.pid = None, 0

    def reboot(self, timeout: float = 120.0) -> float:
        self.poweroff()
        return self.boot(timeout)

    def _kill(self) -> None:
        """SIGKILL the container's PID 1 (the kernel ends every process of its PID namespace with it: nspawn's
        own end would leave them running), then nspawn."""
        for pid in (self.pid or self._pid1(), -self.proc.pid):
            try:
                if pid:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.proc.wait(30)
        self.proc, self.pid = None, 0

    def close(self) -> None:
        """Power off (killed if it will not), unmount the overlay and delete its folders: nothing outlives it."""
        try:
            if self.proc is not None:
                self.poweroff(timeout=30)
        finally:
            subprocess.run(
                ["umount", "-l", str(self.merged)], capture_output=True, timeout=30
            )
            for group in self.cgroups:  # emptied by the poweroff: the deepest first
                for folder, _, _ in sorted(os.walk(group), reverse=True):
                    try:
                        os.rmdir(folder)
                    except OSError:
                        pass
            shutil.rmtree(self.workdir, ignore_errors=True)

    # --- inside -------------------------------------------------------------------------------------------------

    def run(
        self,
        *argv: str,
        env: dict | None = None,
        timeout: float = 60.0,
        check: bool = True,
        cwd: str | None = None,
    ) -> subprocess.CompletedProcess:
        """`argv` inside the container (every namespace of its PID 1), with `env` (else a plain PATH)."""
        if not self.pid:
            raise BootError("the container is not booted")
        env = env or {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        }
        wd = [f"--wd={cwd}"] if cwd else []
        out = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-a", *wd, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        if check and out.returncode != 0:
            raise BootError(
                f"{' '.join(argv)} exited {out.returncode} in the container: {out.stderr[-2000:]}"
            )
        return out

    def systemctl(self, *args: str) -> str:
        return self.run("systemctl", *args).stdout

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show -p P1,P2 UNIT` of the real systemd, as a dict."""
        out = self.systemctl("show", "-p", ",".join(props), unit)
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def path(self, inside: str | Path) -> Path:
        """Where a path of the container's own root (not a bound folder) is seen from the host."""
        return self.merged / str(inside).lstrip("/")

    def ns_pid(self, host_pid: int) -> int:
        """The container's number of a host process (0 when it is not one of the container's)."""
        return ns_chain(host_pid)[-1] if self._ours(host_pid) else 0

    def _ours(self, host_pid: int) -> bool:
        try:
            return os.readlink(f"/proc/{host_pid}/ns/pid") == os.readlink(
                f"/proc/{self.pid}/ns/pid"
            )
        except OSError:
            return False

    def processes(self) -> list[psutil.Process]:
        """The container's live processes (as the host sees them)."""
        found = []
        for proc in psutil.process_iter():
            if self._ours(proc.pid):
                found.append(proc)
        return found


def ns_chain(pid: int) -> list[int]:
    """A process's PID in each PID namespace it is in, the host's first (/proc/PID/status's NSpid)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []
