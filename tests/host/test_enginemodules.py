"""deployments.host.enginemodules: the optional package a flag needs, asked of the engine's own Python (a real venv
here, made without pip, with a stand-in package dropped into its site-packages)."""
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.host import enginemodules


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """An engine's venv that has fastsafetensors (an empty stand-in) and none of the other optional packages."""
    root = tmp_path_factory.mktemp("engine") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python*/site-packages"))
    (site / "fastsafetensors").mkdir()
    (site / "fastsafetensors" / "__init__.py").write_text("raise SystemExit('find_spec must not import it')\n")
    return root


def _script(tmp_path: Path, head: str) -> str:
    script = tmp_path / "vllm"
    script.write_text(head + "\nimport sys\n")
    script.chmod(0o755)
    return str(script)


def test_the_engines_own_python_says_which_optional_packages_it_has(venv, tmp_path):
    python = str(venv / "bin" / "python")
    vllm = _script(tmp_path, f"#!{python}")
    assert enginemodules.importable(vllm) == (python, {"fastsafetensors"})
    assert enginemodules.missing({"load-format": "fastsafetensors"}, vllm) == []
    assert enginemodules.missing({"load-format": "tensorizer"}, vllm) == [
        f"--load-format tensorizer needs the Python package tensorizer, which the engine's Python ({python}) cannot "
        f"import. To fix it, install it into the engine's environment (`{python} -m pip install tensorizer`), or "
        "deploy without --load-format tensorizer"]


def test_an_env_shebang_is_the_python_on_the_engines_path(venv, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{venv / 'bin'}:/usr/bin:/bin")
    vllm = _script(tmp_path, "#!/usr/bin/env python3")
    assert enginemodules.interpreter(vllm) == str(venv / "bin" / "python3")
    assert enginemodules.importable(vllm)[1] == {"fastsafetensors"}


def test_pips_sh_wrapper_for_long_paths_names_its_python(venv, tmp_path):
    python = str(venv / "bin" / "python")
    vllm = _script(tmp_path, f"#!/bin/sh\n'''exec' {python} \"$0\" \"$@\"\n' '''")
    assert enginemodules.interpreter(vllm) == python


def test_an_engine_that_is_no_python_script_cannot_be_asked_and_is_not_refused(tmp_path):
    vllm = _script(tmp_path, "#!/bin/sh\nexec /opt/vllm/bin/vllm \"$@\"")
    assert enginemodules.importable(vllm) is None
    assert enginemodules.missing({"load-format": "fastsafetensors"}, vllm) == []


def test_the_engine_is_asked_only_when_a_flag_needs_a_package(monkeypatch):
    monkeypatch.setattr(enginemodules, "importable", lambda *a: pytest.fail("asked without need"))
    assert enginemodules.missing({"max-model-len": 4096, "load-format": "safetensors"}, "/opt/vllm/bin/vllm") == []


def test_each_flag_names_its_own_package_with_pips_spelling(monkeypatch):
    monkeypatch.setattr(enginemodules, "importable", lambda *a: ("/v/bin/python", set()))
    refusals = enginemodules.missing({"quantization": "bitsandbytes", "load-format": "runai_streamer"}, "/v/bin/vllm")
    assert [r.split(", which")[0] for r in refusals] == [
        "--load-format runai_streamer needs the Python package runai-model-streamer",
        "--quantization bitsandbytes needs the Python package bitsandbytes"]


def test_the_fake_engine_has_a_package_exactly_when_the_check_says_so(tmp_path):
    """The double (tests/faults/fakevllm/vllm) runs under the python3 on the PATH, and its fastsafetensors load fails
    without the package there: the check and the engine agree."""
    from tests.truestate import FAKE_VLLM

    python, present = enginemodules.importable(str(FAKE_VLLM))
    if "fastsafetensors" in present:
        pytest.skip(f"{python} has fastsafetensors")
    out = subprocess.run([str(FAKE_VLLM), "serve", str(tmp_path), "--port", "1", "--load-format", "fastsafetensors"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                         env=enginemodules.processenv.engine_environ({}))
    assert out.returncode == 1 and "No module named 'fastsafetensors'" in out.stdout
    assert enginemodules.missing({"load-format": "fastsafetensors"}, str(FAKE_VLLM))[0].startswith(
        f"--load-format fastsafetensors needs the Python package fastsafetensors, which the engine's Python ({python})")
