"""Credentials the panel keeps in its database (the Hugging Face token, each Ray cluster's token) are encrypted
at rest.

Fernet (AES-128-CBC with HMAC-SHA256) under a key in HF_TOKEN_KEY_FILE (default var/hf-token.key),
a file only the panel's user reads (0600: root on GPU hosts; never the engine user). A database dump
or backup alone gives nobody the token. The key is made on first use; every process that reads a
token (web, workers, node agents: every node of a Ray deployment reads its cluster's) needs the same file,
like SECRET_KEY. Stored values carry a prefix,
so a value written before encryption existed is still read (and the migration encrypts it).
"""
import base64
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings

PREFIX = "fernet:"


class Unreadable(Exception):
    """A sealed value this process cannot open: its key file is missing or holds another key."""


def key_path() -> Path:
    return Path(settings.HF_TOKEN_KEY_FILE)


def _make_key(path: Path) -> None:
    """Write a new key 0600, never replacing one another process wrote meanwhile (link, not rename)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(Fernet.generate_key() + b"\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
    finally:
        tmp.unlink(missing_ok=True)


def _fernet(create: bool) -> Fernet:
    path = key_path()
    if not path.exists():
        if not create:
            raise Unreadable(f"the key file {path} is missing on this host (copy it from the host that stored the token)")
        _make_key(path)
    key = path.read_bytes().strip()
    try:
        base64.urlsafe_b64decode(key)
        return Fernet(key)
    except ValueError as exc:
        raise Unreadable(f"{path} holds no Fernet key") from exc


def seal(value: str) -> str:
    """`value` encrypted, as stored in the database (the key file is made when there is none)."""
    return PREFIX + _fernet(create=True).encrypt(value.encode()).decode()


def is_sealed(stored: str) -> bool:
    return stored.startswith(PREFIX)


def unseal(stored: str) -> str:
    """The value of a stored credential (one stored before encryption existed: as it is), or Unreadable."""
    if not is_sealed(stored):
        return stored
    try:
        return _fernet(create=False).decrypt(stored[len(PREFIX):].encode()).decode()
    except InvalidToken as exc:
        raise Unreadable(f"{key_path()} is not the key the token was stored with") from exc
