"""Durable file operations, for every part of the package (the disk store, Mem0's collection files).

A file appears whole or not at all: it is written to a temp file in the same
directory (``.<name>#<random>.tmp``), flushed and fsynced, renamed over its
final name, and the directory is fsynced so the rename survives a crash.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def atomic_write(path: Path, data: bytes) -> None:
    """Temp file in the same directory, flush + fsync, ``os.replace``, fsync the directory."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}#", suffix=TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> bool:
    """Unlink ``path`` if it exists; True if it did."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def make_dir(path: Path) -> None:
    """Create ``path`` (and its parents) durably: each new entry's parent is fsynced."""
    if path.is_dir():
        return
    make_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        path.mkdir()
    fsync_dir(path.parent)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing), across threads and
    processes; released on exit."""
    with open(path, "ab") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        yield


def identity(stat: os.stat_result) -> tuple[int, int, int]:
    """What tells two versions of a file apart: (inode, mtime_ns, size).
    Every rewrite here is a rename of a new file, so it always changes the inode."""
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size)
