"""The server secret: the key of every cache salt (:mod:`inferscale.compose.salt`).

One file, readable by its owner only, shared by everything that serves one data
directory: the facade that builds requests and the engine's connector that
checks them. It is created on first use (32 random bytes, hex, mode 0600);
two processes creating it at once agree on one (the file appears whole, by
``link``, or not at all). A file others can read is refused: whoever reads the
secret can compute any user's salt.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

from inferscale.errors import ConfigError

SECRET_BYTES = 32
#: the shortest secret accepted from a file written by hand (bytes)
MIN_SECRET_BYTES = 16


def load_secret(path: str | os.PathLike) -> bytes:
    """The secret in ``path``, created first if the file does not exist."""
    path = Path(path)
    if not path.exists():
        _create(path)
    return _read(path)


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}#", suffix=".tmp")  # mode 0600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(SECRET_BYTES) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        with contextlib.suppress(FileExistsError):  # another process created it first: use theirs
            os.link(tmp, path)
    finally:
        os.unlink(tmp)


def _read(path: Path) -> bytes:
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        raise ConfigError(f"secret file {path} is not a regular file (a directory, or a device); "
                          f"point secret_file at a file, or remove it to have one created")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"secret file {path} is accessible to other users (mode {stat.S_IMODE(mode):o}); "
                          f"chmod 600 it")
    secret = path.read_bytes().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"secret file {path} holds {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed")
    return secret


def engine_key(secret: bytes) -> str:
    """The key of the engine's port (:mod:`inferscale.server.engine_guard`), derived from the
    secret (never the secret itself): the front sends it, the engine checks it."""
    return hmac.digest(secret, b"inferscale engine key", "sha256").hex()
