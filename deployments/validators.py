"""Validation of what users type, shared by forms and API serializers. Nothing typed reaches a shell;
these rules make the errors clear and keep paths and names inside what the panel expects."""
import re

from django.core.exceptions import ValidationError

# Hugging Face: "org/name", letters, digits, '-', '_', '.', at most 96 characters per part.
REPO_ID = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?/[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$")
REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")
NODE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
PATH = re.compile(r"^/[A-Za-z0-9._/@+-]{0,1023}$")


def validate_repo_id(value: str) -> None:
    if not REPO_ID.match(value or "") or ".." in value or "--" in value:
        raise ValidationError(
            "A Hugging Face repo id looks like org/name (letters, digits, '-', '_', '.'), e.g. moonshotai/Kimi-K2.5.",
            code="invalid_repo_id")


def validate_revision(value: str) -> None:
    if not REVISION.match(value or "") or ".." in value:
        raise ValidationError("A revision is a branch, tag or commit: letters, digits, '.', '_', '-', '/'.",
                              code="invalid_revision")


# System folders are never model folders: refused with everything under them.
SYSTEM_DIRS = ("/proc", "/sys", "/dev", "/etc", "/boot", "/run", "/bin", "/sbin", "/lib", "/lib64", "/usr/bin",
               "/usr/sbin", "/usr/lib", "/var/lib", "/var/run", "/root/.ssh")
# Folders that hold everything: a model lives below them, not in them.
TOP_DIRS = ("/", "/home", "/usr", "/var", "/root", "/tmp", "/opt", "/srv", "/mnt", "/media", "/data")


def validate_local_path(value: str) -> None:
    if not PATH.match(value or "") or any(part in ("..", ".") for part in value.split("/")):
        raise ValidationError("An absolute folder path on the node, without '..' or special characters.",
                              code="invalid_path")
    path = "/" + value.strip("/")
    if path in TOP_DIRS or any(path == d or path.startswith(d + "/") for d in SYSTEM_DIRS):
        raise ValidationError(f"{path} is a system folder, not a model folder.", code="invalid_path")
