"""Files only their owner may read (tokens, keys, units with secrets): created 0600, never readable for a moment."""
import os
from pathlib import Path


def write_private(path: Path | str, text: str) -> None:
    """Write `text` to a new 0600 file next to `path`, then move it into place (atomic, no window)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
