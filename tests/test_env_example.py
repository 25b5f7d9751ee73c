"""Every setting the panel reads from its environment is listed in .env.example with its default: the names the
code reads (controlpanel/settings.py's env_*() helpers and os.environ anywhere in the panel's packages), found in the
source, must each be there, but for the few that only the test harness sets."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("controlpanel", "deployments", "benchmarks", "plumbing", "panelctl")
READ = re.compile(r"""(?:os\.environ\.get|os\.getenv|os\.environ\.setdefault|env_[a-z]+)\(\s*["']([A-Z][A-Z0-9_]+)["']"""
                  r"""|os\.environ\[["']([A-Z][A-Z0-9_]+)["']\]""")
# Set by the test harness or its tools, never by whoever runs the panel.
HARNESS = {
    "PYTEST_XDIST_WORKER": "pytest-xdist names each worker",
    "PANEL_TEST_PASSWORD_HASHER": "controlpanel/pytest_env.py: a fast hasher for the tests",
    "PANEL_TEST_WORKERS": "`./panel test`'s xdist workers",
    "CELERY_TASK_ALWAYS_EAGER": "tests that run a task in the calling process",
    "DJANGO_SETTINGS_MODULE": "set by the entry points themselves",
}


def _read_names() -> dict[str, str]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            for match in READ.finditer(path.read_text()):
                found.setdefault(match.group(1) or match.group(2), str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_panel_reads_is_in_env_example():
    listed = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", (ROOT / ".env.example").read_text(), re.MULTILINE))
    read = _read_names()
    assert len(read) > 50  # the scan sees the settings' own reads, not nothing
    missing = {name: where for name, where in read.items() if name not in listed and name not in HARNESS}
    assert not missing, f"read but not in .env.example: {missing}"
