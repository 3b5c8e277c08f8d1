"""How a job's credential files are written (ps-certs: certs.py, and its --rotate: rotation.py): keys and
tokens with mode 0600, certificates 0644, in folders of mode 0700; a file others read while it changes
(the shards' token table, a task's token) replaced whole. And the tokens themselves: random 256-bit
secrets."""

from __future__ import annotations

import os
import pathlib
import secrets

__all__ = ["new_token", "write_file", "replace_file", "private_dir"]

TOKEN_BYTES = 32


def new_token() -> bytes:
    """A new token: TOKEN_BYTES random bytes, URL-safe base64 (no whitespace: a table line's field)."""
    return secrets.token_urlsafe(TOKEN_BYTES).encode()


def write_file(path: pathlib.Path, data: bytes, secret: bool) -> None:
    """Writes `data` to `path` (mode 0600 if `secret`, else 0644 for a new file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def replace_file(path: pathlib.Path, data: bytes) -> None:
    """Writes `data` to `path` whole: written aside, then renamed over it (a reader never sees half of it).
    Mode 0600."""
    aside = path.with_name(path.name + ".new")
    write_file(aside, data, secret=True)
    os.replace(aside, path)


def private_dir(directory: str | os.PathLike) -> pathlib.Path:
    """`directory`, made if missing, with mode 0700."""
    directory = pathlib.Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    return directory
