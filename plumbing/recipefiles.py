"""The recipe and strategy files of a folder in vllm-project/recipes' layout (a checkout, RECIPES_DIR, the shipped
folder) and the git commit it is at, read without running anything. Plain Python: the panel's loader and
`panelctl recipes import` both read folders through here."""
from pathlib import Path

MAX_FILES, MAX_BYTES = 5000, 1 << 20  # a checkout of vllm-project/recipes holds ~300 files of a few KB
PATTERNS = ("models/*/*.yaml", "models/*/*.yml", "strategies/*.yaml", "strategies/*.yml")


class CheckoutError(ValueError):
    """The folder cannot be read as recipes; the message says why."""


def paths(folder: Path) -> list[Path]:
    """Every models/<org>/<model>.yaml and strategies/<name>.yaml in the folder, sorted."""
    return sorted(p for pattern in PATTERNS for p in folder.glob(pattern) if p.is_file())


def read(folder: Path) -> list[tuple[str, str]]:
    """(path inside the folder, text) of each recipe file; a single file is read as the one file, under its
    path from its models/ or strategies/ folder on."""
    if folder.is_file():
        parts = folder.resolve().parts
        start = max((i for i, p in enumerate(parts) if p in ("models", "strategies")), default=len(parts) - 1)
        return [("/".join(parts[start:]), _text(folder))]
    found = paths(folder)
    if len(found) > MAX_FILES:
        raise CheckoutError(f"{folder} holds {len(found)} recipe files; at most {MAX_FILES} are read")
    return [(p.relative_to(folder).as_posix(), _text(p)) for p in found]


def _text(path: Path) -> str:
    if path.stat().st_size > MAX_BYTES:
        raise CheckoutError(f"{path}: larger than {MAX_BYTES >> 20} MiB, not a recipe")
    return path.read_text(encoding="utf-8", errors="replace")


def version(folder: Path) -> str:
    """The git commit the checkout is at (.git/HEAD and its ref, or packed-refs), or ""."""
    git = next((d / ".git" for d in (folder, *folder.parents) if (d / ".git").is_dir()), None)
    if git is None:
        return ""
    try:
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head[:40]
        ref = head[5:]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()[:40]
        for line in (git / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0][:40]
    except OSError:
        pass
    return ""
