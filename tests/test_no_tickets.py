"""No code, comment, docstring, template, script or test name points at one of the project's own tickets by number:
a reader outside the project's history learns nothing from it, so each says what the code does instead.
A citation of an upstream project's bug tracker (the project named just before the number) stays allowed.
Reads the files as text (the code's folders, docs/, monitoring/ and the files at the root); migrations
(generated, frozen) and third-party vendored files are left out."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("controlpanel", "deployments", "benchmarks", "plumbing", "panelctl", "tests", "templates", "static", "perf",
           "scripts", "monitoring", "docs")
ROOT_FILES = ("docker-compose.yml", "pyproject.toml", "Dockerfile", "Dockerfile.node", "README.md", "panel", "manage.py")
SKIPPED_DIRS = {"migrations", "__pycache__", "node_modules"}
VENDORED = ROOT / "static" / "vendor"
TICKET = re.compile(r"\b(?:issues?|tickets?) ?#?\d+\b", re.IGNORECASE)
# An upstream project named right before the number (vLLM's or GPUStack's own issue numbers) is a citation.
UPSTREAM = re.compile(r"\b(?:vllm|gpustack|xinference|ray|nccl|celery|django|pytorch|torch|huggingface|transformers|"
                      r"redis|uvicorn|daphne|channels|nvidia)(?:'s)?(?:\s+github)?\s*$", re.IGNORECASE)


def _files():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if (not path.is_file() or SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts)
                    or VENDORED in path.parents):
                continue
            data = path.read_bytes()
            if b"\0" in data:
                continue  # binary
            yield path, data.decode("utf-8", errors="replace")
    for name in ROOT_FILES:
        if (ROOT / name).is_file():
            yield ROOT / name, (ROOT / name).read_text(errors="replace")


def _ticket_references(text: str) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for match in TICKET.finditer(line):
            if not UPSTREAM.search(line[:match.start()]):
                found.append((number, line.strip()))
                break
    return found


def test_the_pattern_finds_a_ticket_and_spares_an_upstream_citation():
    assert _ticket_references("x = 1  # see " + "issue" + " 17: the head first")
    assert _ticket_references("Issues" + " 26 and 27")
    assert not _ticket_references("a bug of vLLM " + "issue" + " #12345, worked around here")
    assert not _ticket_references("tokens.issue(user)  # a new token")


def test_no_file_names_a_ticket_number():
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line[:120]}"
                 for path, text in _files() for number, line in _ticket_references(text)]
    assert not offenders, "ticket numbers mean nothing to a reader; say what the code does:\n" + "\n".join(offenders)
