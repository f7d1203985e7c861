"""RedisStore (``"redis"``): every user's facts on a Redis server, the store of record that
replicas share.

The disk store's format 3 without the files (``docs/storage-format.md``): each user is one Redis
hash, ``<prefix>:user:<user_id>``, whose fields are

    index                     the user's index (facts, token ids, records, segments, epoch), as JSON
    epoch                     the index's epoch alone (what a reader checks on every request)
    seg-<hex>.safetensors     a K/V segment (and embeddings), never modified once written

and ``<prefix>:users`` is the set of users with facts. A write (:mod:`inferscale.storage.redis.writes`)
changes the hash and the set in one ``MULTI``/``EXEC`` transaction, guarded by ``WATCH`` on the
user's hash: every reader, on every replica, sees the old version or the new one, and a writer
killed midway leaves nothing. Readers take no lock; a segment replaced under a reader sends it
back to the new index, as on disk. Every segment read is verified against its checksum and the
index.

A server that does not answer raises :class:`~inferscale.errors.StoreUnavailableError`: a chat
then answers by plain prefill (``fallback: "store_unavailable"``), a write fails and commits nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from inferscale.errors import CorruptDataError, StoreUnavailableError, UnknownUserError
from inferscale.storage.format import kvfile, nfc_names
from inferscale.storage.base import KVStore
from inferscale.storage.format.index import UserIndex
from inferscale.storage.format.index_cache import DEFAULT_MIB, IndexCache, cache_bytes
from inferscale.storage.format.reads import IndexReads
from inferscale.storage.layout import check_ids, require_facts
from inferscale.storage.redis.writes import EPOCH_FIELD, INDEX_FIELD, RedisWrites, redis_errors
from inferscale.storage.format.segments import decode_segment, join_segments

#: reads that find a segment gone (a writer replaced it) retry with the new index this often
READ_ATTEMPTS = 3


logger = logging.getLogger(__name__)


class RedisStore(RedisWrites, IndexReads, KVStore):
    """Durable (as the server is configured: AOF or RDB), shared K/V store of record."""

    name: ClassVar[str] = "redis"
    volatile: ClassVar[bool] = False

    @dataclass(frozen=True)
    class Options:
        #: the server, as redis-py takes it (``redis://[:password@]host:port/db``, ``rediss://`` for TLS)
        url: str = "redis://127.0.0.1:6379/0"
        #: the keys' prefix: several deployments may share one server under different prefixes
        prefix: str = "inferscale"
        #: seconds a call waits for the server before the store counts it unavailable
        timeout_s: float = 5.0
        #: MiB of parsed indexes kept in memory (each counted at 5× its value), least recently used dropped
        index_cache_mib: int = DEFAULT_MIB

        def __post_init__(self):
            if not isinstance(self.url, str) or not self.url.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got {self.url!r}")
            if not isinstance(self.prefix, str) or not self.prefix or ":" in self.prefix:
                raise ValueError(f"prefix must be a non-empty string without ':', got {self.prefix!r}")
            if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
                raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")
            cache_bytes(self.index_cache_mib)

    def __init__(self, options: Options | None = None, **runtime: Any):
        """Runtime keywords are accepted and ignored."""
        self.options = options or self.Options()
        self.client = _client(self.options)
        #: user -> their parsed index, while the server's epoch is the index's
        self._indexes = IndexCache(cache_bytes(self.options.index_cache_mib))

    def describe(self) -> str:
        """Where the facts are (for logs): the server without its password, and the prefix."""
        kwargs = self.client.connection_pool.connection_kwargs
        where = kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"
        return f"redis {where} (prefix {self.options.prefix!r})"

    # -- the KVStore interface -------------------------------------------------

    def users(self) -> list[str]:
        with redis_errors(self):
            members = self.client.smembers(self.users_key)
        names = (m.decode() for m in members)
        return sorted(name for name in names if nfc_names.renamed(name) is None)  # another form: until swept

    def epoch(self, user_id: str) -> str | None:
        """The user's epoch as the server holds it now (one small read; None: no such user)."""
        check_ids(user_id, ())
        with redis_errors(self):
            value = self.client.hget(self.user_key(user_id), EPOCH_FIELD)
        return value.decode() if value is not None else None

    # -- beyond the interface (what the disk store offers too) -----------------

    def embeddings(self, user_id: str) -> tuple[list[str], torch.Tensor]:
        try:
            index, user = self._read(user_id, None)
        except UnknownUserError:
            return [], torch.empty(0, 0)
        ids = [f for f in index.facts if f in user.embeddings]
        return (ids, torch.stack([user.embeddings[f] for f in ids])) if ids else ([], torch.empty(0, 0))

    def sweep(self) -> list[str]:
        """Nothing interrupted to sweep (a write is one transaction); users stored under an id
        not in NFC are renamed to its NFC form (:mod:`inferscale.storage.format.nfc_names`). Returns
        the users renamed."""
        with redis_errors(self):
            members = [m.decode() for m in self.client.smembers(self.users_key)]
            return [new for old, new in nfc_names.to_rename(members) if self._rename_user(old, new)]

    def _rename_user(self, old: str, new: str) -> bool:
        source, target = self.user_key(old), self.user_key(new)
        if self.client.exists(source) and not self.client.renamenx(source, target):
            logger.error("%s: user %r is stored in two Unicode forms; %r is left as it is", self.describe(), new, old)
            return False
        pipe = self.client.pipeline(transaction=True).srem(self.users_key, old)
        if self.client.exists(target):
            pipe.sadd(self.users_key, new)
        pipe.execute()
        return True

    # -- reading ---------------------------------------------------------------

    def _read(self, user_id: str, fact_ids: Sequence[str] | None) -> tuple[UserIndex, kvfile.UserFile]:
        """The index and the verified facts of the segments holding ``fact_ids`` (None: all)."""
        for _ in range(READ_ATTEMPTS):
            index = self._require_index(user_id)
            wanted = list(index.facts) if fact_ids is None else fact_ids
            require_facts(user_id, wanted, index.facts)
            names = list(dict.fromkeys(index.facts[f].segment for f in wanted))
            with redis_errors(self):
                blobs = self.client.hmget(self.user_key(user_id), names) if names else []
            if all(blob is not None for blob in blobs):
                where = f"{self.describe()} user {user_id!r}"
                return index, join_segments(index, {n: decode_segment(index, n, b, f"{where} {n}")
                                                    for n, b in zip(names, blobs)})
        raise CorruptDataError(f"{self.describe()}: user {user_id!r}: a segment the index lists is missing")

    def _index(self, user_id: str) -> UserIndex | None:
        """The user's index, parsed again only when the server's epoch differs from the cached one."""
        epoch = self.epoch(user_id)
        if epoch is None:
            self._forget_index(user_id)
            return None
        cached = self._indexes.get(user_id, epoch)
        if cached is not None:
            return cached
        with redis_errors(self):
            data = self.client.hget(self.user_key(user_id), INDEX_FIELD)
        if data is None:  # deleted since
            return None
        index = UserIndex.decode(data, user_id, f"{self.describe()} user {user_id!r} index")
        self._indexes.put(user_id, index.epoch, index, len(data))
        return index

    def _forget_index(self, user_id: str) -> None:
        self._indexes.pop(user_id)


def _client(options: RedisStore.Options):
    try:
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry
    except ImportError:
        raise StoreUnavailableError("kv store 'redis' needs the redis client: pip install "
                                    "'inferscale-kv[cluster]' (or redis)") from None
    return redis.Redis.from_url(options.url, socket_timeout=options.timeout_s,
                                socket_connect_timeout=min(options.timeout_s, 2.0),
                                retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2))


__all__ = ["READ_ATTEMPTS", "RedisStore"]
