"""Root never follows an engine's paths. The agent runs as root; the engine user owns its home, its caches,
Ray's folder in that home and its compile-cache folder, and may plant a link in any of them, or swap a folder
for one while root works there. Each place is tried here as a throw-away engine user on this machine, against
the agent's real code: a root-only folder and file named by the planted links keep their owner and mode."""
import ctypes
import os
import shutil
import stat
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from deployments.host import compilecache, osuser
from deployments.node import raycluster, steps
from tests.factories import DeploymentFactory

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a throw-away user and root's hands need root")
PY = "/usr/bin/python3"  # readable by every user, unlike the panel's venv


@pytest.fixture
def place():
    """A folder every user may enter (the engine user's home goes in it), removed at the end."""
    base = Path(tempfile.mkdtemp(prefix="root-links-", dir="/var/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def engine(place):
    name = f"pl{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "--system", "--user-group", "--home-dir", str(place / name), "--no-create-home",
                    "--shell", "/usr/sbin/nologin", name], check=True, capture_output=True, timeout=60)
    try:
        yield osuser.resolve(name)  # makes its home and caches, as every agent start does
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True, timeout=60)


@pytest.fixture
def secret(place):
    """What an engine would love to own: a root-only folder holding a root-only file."""
    folder = place / "root-only"
    folder.mkdir(mode=0o700)
    (folder / "key").write_text("sealed")
    (folder / "key").chmod(0o600)
    return folder


def _state(*paths: Path) -> list[tuple]:
    return [(p, (st := os.lstat(p)).st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) for p in paths]


def as_user(user, *argv, check=True, **kwargs):
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, timeout=60,
                          **user.popen_kwargs(), **kwargs)


def test_links_planted_in_the_engines_home_lead_root_nowhere(engine, secret):
    home = Path(engine.home)
    assert _state(home)[0][1:] == (engine.uid, engine.gid, 0o750)
    assert all(Path(v).is_dir() and Path(v).stat().st_uid == engine.uid
               for k, v in engine.environ().items() if k in osuser.CACHE_ENV)
    before = _state(secret, secret / "key")
    as_user(engine, "rm", "-rf", str(home / ".cache" / "torchinductor"))
    as_user(engine, "ln", "-s", str(secret), str(home / ".cache" / "torchinductor"))
    osuser.ensure_home(engine)  # the next agent start
    assert _state(secret, secret / "key") == before
    # A link above a cache folder: the engine user cannot make its folder in root's, and says so.
    as_user(engine, "rm", "-rf", str(home / ".triton"))
    as_user(engine, "ln", "-s", str(secret), str(home / ".triton"))
    with pytest.raises(osuser.EngineUserError, match=r"could not make its folders: .*\.triton"):
        osuser.ensure_home(engine)
    assert _state(secret, secret / "key") == before and os.listdir(secret) == ["key"]


@pytest.mark.django_db
def test_a_link_planted_as_rays_folder_leads_root_nowhere(engine, secret, monkeypatch):
    monkeypatch.setattr(raycluster, "engine_user", lambda *_: engine)
    d = DeploymentFactory()
    made = Path(raycluster._temp_dir(d))
    assert made == Path(engine.home) / "ray" / str(d.pk) and made.stat().st_uid == engine.uid
    before = _state(secret, secret / "key")
    as_user(engine, "rm", "-rf", str(Path(engine.home) / "ray"))
    as_user(engine, "ln", "-s", str(secret), str(Path(engine.home) / "ray"))
    with pytest.raises(steps.PlanFailed, match="Cannot make Ray's folder on this node"):
        raycluster._temp_dir(d)
    assert _state(secret, secret / "key") == before and os.listdir(secret) == ["key"]


SWAP = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b, stop = sys.argv[1], sys.argv[2], sys.argv[3]
while not os.path.exists(stop):  # renameat2(RENAME_EXCHANGE): the folder and the link trade places
    libc.renameat2(-100, a.encode(), -100, b.encode(), 2)
"""


def test_a_folder_swapped_for_a_link_in_the_compile_cache_never_hands_root_a_file(engine, secret, place):
    assert ctypes.CDLL(None).renameat2  # the swap the attack used (glibc >= 2.28)
    store = place / "store"
    store.mkdir(mode=0o700)
    key = "k" * 16
    path = Path(compilecache.prepare(store, store / "org--m", key, engine).path)
    # The engine fills its cache as an Inductor cache looks (thousands of files), with a folder and a link
    # to root's file that a loop swaps all the while.
    fill = ("import os, sys; p = sys.argv[1]; os.makedirs(p + '/d/sub'); [open(f'{p}/d/sub/{i}', 'w').close() "
            "for i in range(2000)]; os.symlink(sys.argv[2], p + '/l')")
    as_user(engine, PY, "-c", fill, str(path), str(secret / "key"))
    stop = place / "stop"
    swapper = subprocess.Popen([PY, "-c", SWAP, str(path / "d"), str(path / "l"), str(stop)],
                               **engine.popen_kwargs())
    before = _state(secret, secret / "key")
    try:
        for _ in range(20):  # a launch each: an operator may Restart at will
            again = compilecache.prepare(store, store / "org--m", key, engine)
            assert again.path == str(path)
            assert _state(secret, secret / "key") == before
    finally:
        stop.touch()
        swapper.wait(30)
    assert swapper.returncode == 0
    assert _state(path)[0][1:] == (engine.uid, engine.gid, 0o700)


def test_a_compile_cache_folder_an_earlier_agent_made_as_root_is_made_again_not_walked(engine, place):
    store = place / "store"
    store.mkdir(mode=0o700)
    folder = store / compilecache.ROOT_NAME / "org--m" / "k1"
    folder.mkdir(parents=True)  # root's, as an earlier agent left it, with root's files in it
    (folder / "torch_compile_cache").mkdir()
    (folder / "torch_compile_cache" / "model").write_bytes(b"x" * 100)
    prepared = compilecache.prepare(store, store / "org--m", "k1", engine)
    assert prepared.path == str(folder) and not prepared.warm and prepared.bytes == 0  # one cold compile
    assert _state(folder)[0][1:] == (engine.uid, engine.gid, 0o700) and os.listdir(folder) == []
    # The engine's own folder and what it wrote stay as they are: nothing in it is walked as root.
    as_user(engine, PY, "-c", "import os, sys; os.mkdir(sys.argv[1]); open(sys.argv[1] + '/f', 'w').write('y')",
            str(folder / "torch_compile_cache"))
    again = compilecache.prepare(store, store / "org--m", "k1", engine)
    assert again.warm and again.bytes == 1


@pytest.mark.django_db
def test_a_local_model_folder_is_read_as_the_engine_user_and_only_below_the_declared_roots(place, engine, secret,
                                                                                         settings, monkeypatch):
    """An operator named a `root:root 0700` folder as a local model, and the agent (root) listed it and read its
    config.json for every viewer. Now only folders below the model store or LOCAL_MODEL_ROOTS are read, and read as
    the engine user: what it cannot read, the panel does not show."""
    from deployments.models import ModelRepo
    from deployments.services import repos
    from tests.factories import NodeFactory

    models = place / "models"
    model = models / "tiny"
    model.mkdir(parents=True)
    configs = Path(__file__).parent.parent / "fixtures" / "configs"
    (model / "config.json").write_text((configs / "llama-3.1-8b-instruct.json").read_text())
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    for path in (models, model):
        path.chmod(0o755)
    (secret / "config.json").write_text('{"model_type": "llama", "hidden": "root only"}')
    monkeypatch.setattr(osuser, "current", lambda: engine)
    node = NodeFactory(model_store=str(place / "store"))
    settings.LOCAL_MODEL_ROOTS = [str(models)]

    def inspected(path):
        row = ModelRepo.objects.create(repo_id=f"local/{uuid.uuid4().hex[:6]}", revision=path, local_path=path)
        return repos.model_inspect_local(row.pk, node.pk)

    outside = inspected(str(secret))  # not below a declared root: refused before anything is read
    assert outside.inspect_error.startswith(f"{secret} is outside the folders this node reads models from "
                                            f"({place / 'store'}, {models}): an admin adds one with LOCAL_MODEL_ROOTS")
    assert outside.files == [] and outside.config == {}
    settings.LOCAL_MODEL_ROOTS = [str(place)]  # declared now: read as the engine user, who may not
    denied = inspected(str(secret))
    assert "not a folder this node's engines may read" in denied.inspect_error or "has no config.json" in denied.inspect_error
    assert denied.inspect_error.endswith(f"(read as {engine.name}, who runs the engines)")
    assert denied.files == [] and denied.config == {} and not denied.copies.exists()
    link = models / "link-to-secret"  # a link from inside a root to outside it: judged where it leads
    link.symlink_to(secret)
    settings.LOCAL_MODEL_ROOTS = [str(models)]
    assert "is outside the folders" in inspected(str(link)).inspect_error
    ok = inspected(str(model))
    assert ok.inspect_error == "" and [f["path"] for f in ok.files] == ["config.json", "model.safetensors"]
    assert ok.copies.get(node=node).state == "ready"
