"""The tree passes the linter pyproject.toml configures ([tool.ruff]: Pyflakes and syntax errors), as CI's first check
of every change: an unused import or an undefined name fails here with ruff's own report."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing_in_the_tree():
    ruff = Path(sys.executable).with_name("ruff")
    found = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert found.returncode == 0, found.stdout + found.stderr
