"""Who engines run as: a dedicated unprivileged system user when the agent is root.

Why: an engine runs code the panel did not write (vLLM, and a model repository's Python under
--trust-remote-code). As root it could read the agent's environment (/proc/<pid>/environ), the panel's
var/ folder (secret key, SQLite file) and signal the agent. As its own user (default `vllm-engine`,
PANEL_ENGINE_USER on the agent) it can do none of that: /proc/<pid>/environ is readable by its owner
only, var/ is the panel's (0700, or 0710 with this user's group where the model store lies inside it),
and the kernel refuses signals across users. Every engine also starts with no_new_privs, so no setuid
program gives root back.

Where the agent is not root it cannot switch users: engines run as the agent's user, and the node page
says so. PANEL_ENGINE_USER=root keeps engines as root (an explicit, documented opt-out).

Standard library only: scripts/install-engine runs this file to create the user
(`python3 deployments/host/osuser.py create`). No Django.
"""
from __future__ import annotations

import ctypes
import glob
import json
import grp
import os
import pwd
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_NAME = "vllm-engine"
HOME_ROOT = Path("/var/lib")
# Device nodes an engine opens: NVIDIA's (often 0666, else a group such as video) and DRM's (render).
DEVICE_GLOBS = ("/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/dri/*")
# Caches an engine writes; under its own home, since the agent's (root's) are not its to write.
CACHE_ENV = {"XDG_CACHE_HOME": ".cache", "VLLM_CACHE_ROOT": ".cache/vllm", "HF_HOME": ".cache/huggingface",
             "TRITON_HOME": ".", "TRITON_CACHE_DIR": ".triton/cache", "TORCHINDUCTOR_CACHE_DIR": ".cache/torchinductor"}
PR_SET_NO_NEW_PRIVS = 38


class EngineUserError(Exception):
    """The engine user cannot be found or created, or cannot reach what an engine needs."""


@dataclass(frozen=True)
class EngineUser:
    """The account engines run as. separate=False: the agent's own (it is not root, or the admin said root)."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    home: str = ""
    separate: bool = True
    note: str = ""
    group_names: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        """What the node page says under "Engines run as"."""
        if self.separate:
            return f"{self.name} (uid {self.uid})"
        return f"the agent's user, {self.name} (uid {self.uid}): {self.note}"

    def facts(self) -> dict:
        """What the agent reports about it (Node.engine_user)."""
        return {**asdict(self), "groups": list(self.groups), "group_names": list(self.group_names),
                "describe": self.describe()}

    def environ(self) -> dict[str, str]:
        """Variables that point an engine at its own home and caches (empty for the agent's own user)."""
        if not self.separate:
            return {}
        home = Path(self.home)
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name,
                **{name: str(home / sub) for name, sub in CACHE_ENV.items()}}

    def popen_kwargs(self) -> dict:
        """subprocess.Popen's user/group/extra_groups for this user ({} when it is the agent's own)."""
        if not self.separate:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}


def from_facts(facts: dict | None) -> EngineUser | None:
    """The EngineUser an agent reported (Node.engine_user), for pages rendered away from the node."""
    if not facts or "uid" not in facts:
        return None
    return EngineUser(name=facts["name"], uid=facts["uid"], gid=facts["gid"], groups=tuple(facts.get("groups", ())),
                      home=facts.get("home", ""), separate=facts.get("separate", False), note=facts.get("note", ""),
                      group_names=tuple(facts.get("group_names", ())))


def configured_name() -> str:
    return os.environ.get("PANEL_ENGINE_USER", DEFAULT_NAME).strip()


def _own(note: str) -> EngineUser:
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = str(uid)
    return EngineUser(name=name, uid=uid, gid=os.getegid(), groups=tuple(os.getgroups()), home=os.path.expanduser("~"),
                      separate=False, note=note)


def device_groups(globs: tuple[str, ...] = DEVICE_GLOBS) -> set[int]:
    """Groups that own GPU device nodes with group read/write (not root's group, not world-writable nodes)."""
    gids = set()
    for pattern in globs:
        for path in glob.glob(pattern):
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISCHR(st.st_mode) and st.st_gid != 0 and st.st_mode & 0o060 == 0o060:
                gids.add(st.st_gid)
    return gids


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def create(name: str, home: Path | None = None) -> None:
    """Create `name` as a system user with its own group, home and no login shell (root only).
    Several agents may start at once on one host: a user made meanwhile by another is fine."""
    home = home or HOME_ROOT / name
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    shell = next((s for s in ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false") if os.path.exists(s)), "/bin/false")
    for attempt in range(5):
        try:
            pwd.getpwnam(name)
            return
        except KeyError:
            pass
        try:
            out = subprocess.run([useradd, "--system", "--user-group", "--home-dir", str(home), "--no-create-home",
                                  "--shell", shell, "--comment", "vLLM engines (vllm-controlpanel)", name],
                                 capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise EngineUserError(f"cannot create the engine user {name!r}: {exc} (create it by hand: "
                                  f"useradd --system --user-group {name}, or set PANEL_ENGINE_USER)") from exc
        if out.returncode == 0:
            return
        if "lock" in out.stderr:  # another useradd holds /etc/passwd's lock: ours goes next
            time.sleep(0.2 * (attempt + 1))
            continue
        try:
            pwd.getpwnam(name)
            return
        except KeyError:
            raise EngineUserError(f"cannot create the engine user {name!r}: {out.stderr.strip()[-300:]}") from None
    raise EngineUserError(f"cannot create the engine user {name!r}: /etc/passwd stayed locked")


def ensure_home(user: EngineUser) -> None:
    """The user's home (0750: other local users need nothing there) and its cache folders, made by the user.

    The home's path is root's (its parent, e.g. /var/lib, is): root makes it and hands it over through a
    descriptor. What lies inside is the engine's to change at will, a link planted in place of ~/.cache
    included, so root never goes there: the user makes its cache folders itself (make_dirs_as)."""
    if not user.separate:
        return
    home = Path(user.home)
    home.parent.mkdir(parents=True, exist_ok=True)
    try:
        own_folder(home, user, 0o750, follow=True)  # an admin may have made the home a link to a bigger disk
    except OSError as exc:
        raise EngineUserError(f"cannot make the engine user's home {home}: {exc}") from exc
    make_dirs_as(user, sorted({v for k, v in user.environ().items() if k in CACHE_ENV} - {user.home}))


def own_folder(path: str | Path, user: EngineUser, mode: int, follow: bool = False) -> None:
    """Make folder `path` (if missing) and give it to `user` with `mode`, through a descriptor: the owner and
    mode change on what was opened, so a swap after the open changes nothing. Without `follow`, a link at
    `path` is refused (OSError ELOOP), its target untouched. For a path whose folders above are root's only."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW))
    try:
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (user.uid, user.gid):
            os.fchown(fd, user.uid, user.gid)
        if stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_dirs_as(user: EngineUser, paths: list[str | Path]) -> None:
    """`mkdir -p` of `paths` run as `user`, for folders in places the user owns: root never goes through a
    path the engine controls, so a link the engine planted leads nowhere the engine could not go itself."""
    if not paths:
        return
    if not user.separate:
        for path in paths:
            Path(path).mkdir(parents=True, exist_ok=True)
        return
    mkdir = shutil.which("mkdir") or "/bin/mkdir"
    try:
        out = subprocess.run([mkdir, "-p", "--", *map(str, paths)], capture_output=True, text=True, timeout=30,
                             stdin=subprocess.DEVNULL, **user.popen_kwargs())
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EngineUserError(f"the engine user {user.name} could not make {', '.join(map(str, paths))}: {exc}") from exc
    if out.returncode != 0:
        raise EngineUserError(f"the engine user {user.name} could not make its folders: {out.stderr.strip()[-300:]}")


def resolve(name: str | None = None, make: bool = True) -> EngineUser:
    """The engine user for this agent, created (with its home) when missing and the agent is root."""
    if os.geteuid() != 0:
        return _own("the agent is not root, so it cannot start engines as another user")
    name = configured_name() if name is None else name
    if name in ("", "root", "0"):
        return _own("PANEL_ENGINE_USER=root: engines can read the agent's secrets")
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        if not make:
            raise EngineUserError(f"the engine user {name!r} does not exist") from None
        create(name)
        entry = pwd.getpwnam(name)
    if entry.pw_uid == 0:
        return _own(f"PANEL_ENGINE_USER={name} is root")
    groups = sorted(set(os.getgrouplist(name, entry.pw_gid)) - {entry.pw_gid} | device_groups())
    home = entry.pw_dir if entry.pw_dir and entry.pw_dir not in ("/", "/nonexistent") else str(HOME_ROOT / name)
    user = EngineUser(name=name, uid=entry.pw_uid, gid=entry.pw_gid, groups=tuple(groups), home=home,
                      group_names=tuple(_group_name(g) for g in groups))
    if make:
        ensure_home(user)
    return user


_current: dict[str, EngineUser] = {}


def current() -> EngineUser:
    """resolve() once per process and setting (creating a user costs a useradd)."""
    key = f"{os.geteuid()}:{configured_name()}"
    if key not in _current:
        _current[key] = resolve()
    return _current[key]


# --- at launch ---------------------------------------------------------------------------------


def no_new_privs() -> None:
    """preexec_fn where setpriv is missing: PR_SET_NO_NEW_PRIVS, so setuid programs cannot raise privileges."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


def argv_prefix() -> list[str]:
    """`setpriv --no-new-privs --`, which execs the engine in place (same PID), or [] (then no_new_privs())."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--no-new-privs", "--"] if setpriv else []


def can_reach(user: EngineUser, path: str | Path, want: str = "r") -> bool:
    """True if `user` can read (r) or run (x) `path`, a folder also entered: asked as that user, so ACLs,
    groups and every parent folder count."""
    if not user.separate:
        return True
    test = shutil.which("test") or "/usr/bin/test"
    args = [test, "-r" if want == "r" else "-x", str(path)]
    if want == "r" and os.path.isdir(path):
        args += ["-a", "-x", str(path)]
    try:
        return subprocess.run(args, timeout=10, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, **user.popen_kwargs()).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def share(user: EngineUser, folder: str | Path, root: str | Path) -> list[str]:
    """Let the engine user read model `folder` inside `root` (the model store the agent downloads into,
    private under the launcher's umask): the folder's files get its group and g+rX, and `root` and the
    folders between enter-only (g+x) for its group. Nothing outside `root` is touched, a folder of the
    user's own (a local model) never: those must be readable already. Returns the paths changed."""
    if not user.separate:
        return []
    folder, root = Path(folder).resolve(), Path(root).resolve()
    if folder == root or root not in folder.parents or not folder.is_dir():
        return []  # outside the store, or not there (yet): the engine's own start says what is missing
    changed = []

    def grant(path: Path, bits: int) -> None:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            return  # a link inside a model folder (HF's snapshots) is followed to its target, itself granted
        if st.st_gid == user.gid and st.st_mode & bits == bits:
            return
        os.chown(path, -1, user.gid, follow_symlinks=False)
        os.chmod(path, stat.S_IMODE(st.st_mode) | bits)
        changed.append(str(path))

    for parent in [root, *reversed([p for p in folder.parents if root in p.parents])]:
        grant(parent, 0o010)
    for dirpath, dirnames, filenames in os.walk(folder):
        grant(Path(dirpath), 0o050)
        for name in filenames:
            grant(Path(dirpath) / name, 0o040)
    return changed


def protect(var_dir: str | Path, user: EngineUser | None = None) -> None:
    """The panel's var/ folder, run by the agent at start as root: 0710 with the engine user's group
    (enter-only: an engine cannot list it, and reaches inside only the model folders share() opened and
    what an admin made world-readable there), 0700 where engines are the agent's own user; its files
    (secret key, SQLite database, tokens) 0600 or stricter, its logs, Redis and Ray folders 0700."""
    var_dir = Path(var_dir)
    if not var_dir.is_dir() or os.geteuid() != 0:
        return
    if user is not None and user.separate:
        os.chown(var_dir, -1, user.gid)
        os.chmod(var_dir, 0o710)
    else:
        os.chmod(var_dir, 0o700)
    for entry in var_dir.iterdir():
        try:
            st = entry.lstat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            os.chmod(entry, stat.S_IMODE(st.st_mode) & 0o700)
        elif stat.S_ISDIR(st.st_mode) and entry.name in ("logs", "redis", "ray"):
            os.chmod(entry, 0o700)


def main(argv: list[str]) -> int:
    """`osuser.py create`: make the engine user (install step); `osuser.py show`: print it."""
    if len(argv) != 2 or argv[1] not in ("create", "show"):
        print("usage: osuser.py create|show", file=sys.stderr)
        return 2
    try:
        user = resolve(make=argv[1] == "create")
    except EngineUserError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"engines run as {user.describe()}" + (f", groups {', '.join(user.group_names)}" if user.group_names else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))


def any_python() -> str | None:
    """A Python interpreter any uid may run, for a child that drops to another user (the agent's own may sit under
    root's 0700 home, as pyenv's does); None when there is none."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3", "/usr/local/bin/python3"):
        if candidate and os.path.exists(candidate):
            real = Path(os.path.realpath(candidate))
            if real.stat().st_mode & 0o001 and all(parent.stat().st_mode & 0o001 for parent in real.parents):
                return str(real)
    return None


def python_as(source: str, args: list[str], uid: int, gid: int, groups=(), timeout: float = 60):
    """Run Python `source` with `args` as `uid` (root only) in a child of its own and return the JSON it printed;
    OSError (no interpreter that uid may run, or the child cannot start), SubprocessError or ValueError otherwise."""
    python = any_python()
    if python is None:
        raise OSError("no Python interpreter here that another uid may run")
    out = subprocess.run([python, "-I", "-S", "-c", source, *args], user=uid, group=gid, extra_groups=list(groups),
                         capture_output=True, text=True, timeout=timeout, cwd="/")
    return json.loads(out.stdout)
