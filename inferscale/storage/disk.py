"""DiskStore: one checksummed safetensors file per user, replaced atomically.

``<root>/<user_id>.safetensors`` (``/`` and ``%`` in the id escaped) holds all of a user's facts (format:
:mod:`inferscale.storage.kvfile`, ``docs/storage-format.md``). Every write
goes to a temp file in ``root`` (``.<user_id>.safetensors#<random>.tmp``),
is flushed and fsynced, ``os.replace``d over the old file, and the directory
is fsynced: a crash leaves either the old or the new file, never a mix.
Writers (``put``/``delete``, which read-merge-rewrite) take an exclusive
``flock`` on ``<root>/.lock``, so stores in several threads or processes
sharing a root do not lose each other's updates. Readers take no lock.

The file holds everything a fact is — K/V, token ids, text, source turn and
embedding — so one ``put`` commits a fact whole and every reader reads it from
here. Every read of K/V verifies the file's checksum; ``embeddings`` (the
index rebuild at start-up) reads the embedding tensors alone. ``list``/``token_ids``/
``facts``/``nbytes`` use a small cache of verified indexes keyed by the file's
(path, inode, mtime_ns, size), so they re-read a file only after it changed.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from inferscale.devices import resolve_device
from inferscale.errors import UnknownUserError
from inferscale.facts import Fact, user_file_stem, user_from_file_stem
from inferscale.kv import FactKV, KVBatch
from inferscale.storage import kvfile
from inferscale.storage.base import KVStore
from inferscale.storage.blocks import empty_batch
from inferscale.storage.layout import KVLayout, check_ids, check_layout, require_facts

SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
LOCK_NAME = ".lock"
CACHE_SIZE = 256


@dataclass(frozen=True)
class _Index:
    """What ``list``/``token_ids``/``facts``/``nbytes`` need from a verified file."""

    layout: KVLayout
    token_ids: Mapping[str, tuple[int, ...]]
    records: Mapping[str, dict]

    @classmethod
    def of(cls, user: kvfile.UserFile) -> _Index:
        return cls(user.layout, {f: kv.token_ids for f, kv in user.facts.items()}, user.records)

    @property
    def nbytes(self) -> int:
        return sum(len(ids) for ids in self.token_ids.values()) * self.layout.token_nbytes()


class DiskStore(KVStore):
    """Durable K/V store; ``get`` reads, verifies and concatenates on the CPU, then moves."""

    name: ClassVar[str] = "disk"
    volatile: ClassVar[bool] = False

    @dataclass(frozen=True)
    class Options:
        #: directory of the users' files (created if missing; ``~`` expanded)
        root: str

        def __post_init__(self):
            if not isinstance(self.root, str) or not self.root:
                raise ValueError(f"root must be a non-empty path string, got {self.root!r}")

    def __init__(self, options: Options, **runtime: Any):
        """Runtime keywords are accepted and ignored (the root comes from the options)."""
        self.root = Path(os.path.expanduser(options.root))
        self.root.mkdir(parents=True, exist_ok=True)
        self._cache: OrderedDict[tuple, _Index] = OrderedDict()
        self._cache_lock = threading.Lock()

    # -- the KVStore interface -------------------------------------------------

    def put(self, user_id: str, facts: Mapping[str, FactKV], records: Mapping[str, Fact] | None = None,
            embeddings: Mapping[str, torch.Tensor] | None = None) -> None:
        """Merge ``facts`` into the user's file (read, verify, merge, rewrite atomically).

        ``records`` (text and source turn) and ``embeddings`` of those facts, when
        given, are committed in the same write: a fact is stored whole or not at all.
        """
        check_ids(user_id, facts)
        if not facts:
            return
        check_layout(user_id, facts, None)
        records, embeddings = dict(records or {}), dict(embeddings or {})
        if not set(records) | set(embeddings) <= set(facts):
            raise ValueError("records and embeddings must belong to the facts being put")
        with self._writer():
            self._remove_temps(user_id)
            old = self._read(user_id)
            layout = check_layout(user_id, facts, old.layout if old else None)
            merged = old or kvfile.UserFile(layout, {})
            for fact_id, kv in facts.items():
                merged.facts[fact_id] = kv
                merged.records.pop(fact_id, None)
                merged.embeddings.pop(fact_id, None)
            merged.records.update({f: {"text": r.text, "source_turn": r.source_turn} for f, r in records.items()})
            merged.embeddings.update({f: e.detach().to("cpu", torch.float32).reshape(-1) for f, e in embeddings.items()})
            self._write(user_id, merged)

    def get(self, user_id: str, fact_ids: Sequence[str], device: torch.device | str | None = None) -> KVBatch:
        target = resolve_device(device, torch.device("cpu"))
        fact_ids = list(fact_ids)
        if not fact_ids:
            index = self._index(user_id)
            return empty_batch(index.layout if index else None, target)
        user = self._require(user_id)
        require_facts(user_id, fact_ids, user.facts)
        kvs = [user.facts[f] for f in fact_ids]
        keys = torch.cat([kv.keys for kv in kvs], dim=1).to(target)
        values = torch.cat([kv.values for kv in kvs], dim=1).to(target)
        return KVBatch(fact_ids, [kv.token_ids for kv in kvs], keys, values)

    def delete(self, user_id: str, fact_ids: Sequence[str] | None = None) -> None:
        """Idempotent. Deleting a whole user removes the file even if it is corrupt."""
        path = self.path(user_id)
        with self._writer():
            self._remove_temps(user_id)
            if fact_ids is None:
                self._unlink(path)
                return
            old = self._read(user_id)
            if old is None:
                return
            drop = set(fact_ids)
            keep = [f for f in old.facts if f not in drop]
            if len(keep) == len(old.facts):
                return
            if keep:
                self._write(user_id, old.only(keep))
            else:
                self._unlink(path)

    def list(self, user_id: str) -> list[str]:
        index = self._index(user_id)
        return list(index.token_ids) if index else []

    def users(self) -> list[str]:
        """Users with a data file (temp and lock files are never mistaken for one)."""
        names = (p.name for p in self.root.iterdir() if p.name.endswith(SUFFIX) and p.is_file())
        return sorted(user_from_file_stem(name[: -len(SUFFIX)]) for name in names)

    def nbytes(self, user_id: str) -> int:
        """Bytes of K/V (not of the file) stored for the user."""
        index = self._index(user_id)
        return index.nbytes if index else 0

    def token_ids(self, user_id: str, fact_ids: Sequence[str]) -> list[tuple[int, ...]]:
        index = self._index(user_id)
        if index is None:
            raise UnknownUserError(user_id)
        require_facts(user_id, fact_ids, index.token_ids)
        return [index.token_ids[f] for f in fact_ids]

    # -- beyond the interface --------------------------------------------------

    def load_user(self, user_id: str) -> dict[str, FactKV]:
        """All of the user's facts on the CPU, verified (to fill a memory tier)."""
        return self._require(user_id).facts

    def facts(self, user_id: str) -> dict[str, Fact]:
        """The user's facts (text, source turn, token ids), no K/V moved; a fact
        stored without a record has empty text."""
        index = self._index(user_id)
        if index is None:
            return {}
        out = {}
        for fact_id, ids in index.token_ids.items():
            record = index.records.get(fact_id, {})
            out[fact_id] = Fact(fact_id, user_id, record.get("text", ""), record.get("source_turn"), ids)
        return out

    def embeddings(self, user_id: str) -> tuple[list[str], torch.Tensor]:
        """The fact_ids with an embedding and their vectors (``[n, dim]`` float32),
        read without the K/V (see :func:`kvfile.read_embeddings`)."""
        try:
            vectors = kvfile.read_embeddings(str(self.path(user_id)), user_id)
        except FileNotFoundError:
            return [], torch.empty(0, 0)
        if not vectors:
            return [], torch.empty(0, 0)
        return list(vectors), torch.stack(list(vectors.values()))

    def path(self, user_id: str) -> Path:
        """The user's data file (its name escapes ``/`` and ``%``: :func:`~inferscale.facts.user_file_stem`)."""
        check_ids(user_id, ())
        return self.root / f"{user_file_stem(user_id)}{SUFFIX}"

    # -- reading ---------------------------------------------------------------

    def _require(self, user_id: str) -> kvfile.UserFile:
        user = self._read(user_id)
        if user is None:
            raise UnknownUserError(user_id)
        return user

    def _read(self, user_id: str) -> kvfile.UserFile | None:
        """The verified file, or None when there is none; remembers its index."""
        path = self.path(user_id)
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            return None
        with fh:
            stat = os.fstat(fh.fileno())
            data = fh.read()
        user = kvfile.decode(data, user_id, str(path))
        self._remember(_cache_key(path, stat), _Index.of(user))
        return user

    def _index(self, user_id: str) -> _Index | None:
        """The user's verified index, from the cache while the file is unchanged."""
        path = self.path(user_id)
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return None
        with self._cache_lock:
            cached = self._cache.get(_cache_key(path, stat))
        if cached is not None:
            return cached
        user = self._read(user_id)
        return None if user is None else _Index.of(user)

    def _remember(self, key: tuple, index: _Index) -> None:
        with self._cache_lock:
            self._cache[key] = index
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)

    # -- writing ---------------------------------------------------------------

    @contextlib.contextmanager
    def _writer(self) -> Iterator[None]:
        """Exclusive across threads and processes sharing ``root`` (released on close)."""
        with open(self.root / LOCK_NAME, "ab") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            yield

    def _write(self, user_id: str, user: kvfile.UserFile) -> None:
        _atomic_write(self.path(user_id), kvfile.encode(user_id, user))

    def _unlink(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            _fsync_dir(path.parent)

    def _remove_temps(self, user_id: str) -> None:
        """Drop temp files a crashed writer of this user left (we hold the write lock)."""
        pattern = glob.escape(f".{user_file_stem(user_id)}{SUFFIX}") + "#*" + TEMP_SUFFIX
        for stale in self.root.glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()


def _atomic_write(path: Path, data: bytes) -> None:
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
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cache_key(path: Path, stat: os.stat_result) -> tuple:
    return (str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
