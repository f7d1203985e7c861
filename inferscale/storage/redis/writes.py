"""How the Redis store writes (:class:`~inferscale.storage.redis.store.RedisStore` inherits this):
each change of a user is one ``MULTI``/``EXEC`` transaction on the user's hash, guarded by
``WATCH``, laid out as the disk store lays out a commit (one new segment, the rewritten ones
removed, a new index with a new epoch: :mod:`inferscale.storage.format.segments`).

Two replicas writing one user at once: the second's ``EXEC`` finds the hash changed, and that
write starts again from the new version (up to :data:`WRITE_ATTEMPTS` times).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from inferscale.errors import CorruptDataError, InferScaleError, StoreUnavailableError
from inferscale.facts import Fact
from inferscale.kv import FactKV
from inferscale.kv_fp8 import Fp8KV
from inferscale.storage.format import kvfile
from inferscale.storage.format.compaction import segments_to_rewrite
from inferscale.storage.format.index import UserIndex, new_segment_name
from inferscale.storage.format.reads import fresh_user_file
from inferscale.storage.layout import check_ids, check_layout
from inferscale.storage.format.segments import converts, decode_segment, join_segments, make_index, next_version

INDEX_FIELD = "index"
EPOCH_FIELD = "epoch"
WRITE_ATTEMPTS = 16
#: what a change returns: the facts it adds (a UserFile) and the fact ids it removes; None: nothing
Change = Callable[[UserIndex | None], tuple[kvfile.UserFile, set[str]] | None]


@contextlib.contextmanager
def redis_errors(store) -> Iterator[None]:
    """Redis' failures as :class:`StoreUnavailableError`, naming the server (never its password)."""
    import redis

    try:
        yield
    except redis.exceptions.WatchError:
        raise
    except redis.exceptions.RedisError as exc:
        raise StoreUnavailableError(f"{store.describe()} did not answer ({type(exc).__name__}: {exc}); "
                                    f"nothing was read, and a write was not committed") from None


class RedisWrites:
    """The writing half of the Redis store; the store provides ``client``, ``options``,
    ``describe`` and ``_forget_index``."""

    @property
    def users_key(self) -> str:
        return f"{self.options.prefix}:users"

    def user_key(self, user_id: str) -> str:
        return f"{self.options.prefix}:user:{user_id}"

    def put(self, user_id: str, facts: Mapping[str, FactKV | Fp8KV], records: Mapping[str, Fact] | None = None,
            embeddings: Mapping[str, torch.Tensor] | None = None, drop: Sequence[str] = ()) -> None:
        """Add or replace facts (with their records and embeddings, and ``drop`` removed), in one
        transaction: every replica sees all of it or none of it."""
        check_ids(user_id, [*facts, *drop])
        if not facts:
            return
        layout, fresh = fresh_user_file(user_id, facts, records, embeddings)

        def change(current: UserIndex | None):
            check_layout(user_id, facts, current.layout.kept_as(layout.at_rest) if current else None)
            return fresh, set(facts) | set(drop)

        self._transact(user_id, change)

    def delete(self, user_id: str, fact_ids: Sequence[str] | None = None) -> None:
        """Idempotent; a whole user goes with one transaction (their hash and their entry in the set)."""
        check_ids(user_id, ())
        if fact_ids is None:
            with redis_errors(self), self.client.pipeline(transaction=True) as pipe:
                pipe.delete(self.user_key(user_id)).srem(self.users_key, user_id).execute()
            self._forget_index(user_id)
            return

        def change(current: UserIndex | None):
            drop = set(fact_ids) & set(current.facts if current else ())
            return (kvfile.UserFile(current.layout, {}), drop) if drop else None

        self._transact(user_id, change)

    def _transact(self, user_id: str, change: Change) -> None:
        import redis

        key = self.user_key(user_id)
        with redis_errors(self), self.client.pipeline(transaction=True) as pipe:
            for _ in range(WRITE_ATTEMPTS):
                try:
                    pipe.watch(key)
                    current = self._watched_index(pipe, user_id)
                    planned = change(current)
                    if planned is None:
                        pipe.reset()
                        return
                    self._commit(pipe, user_id, current, *planned)
                    return
                except redis.exceptions.WatchError:
                    continue
        raise InferScaleError(f"user {user_id!r}: {WRITE_ATTEMPTS} concurrent writes in a row changed their "
                              f"memory first; nothing was written, try again")

    def _watched_index(self, pipe, user_id: str) -> UserIndex | None:
        data = pipe.hget(self.user_key(user_id), INDEX_FIELD)
        return None if data is None else UserIndex.decode(data, user_id, f"{self.describe()} user {user_id!r} index")

    def _commit(self, pipe, user_id: str, current: UserIndex | None, fresh: kvfile.UserFile, drop: set[str]) -> None:
        """Queue the next version (one new segment, the new index, the rewritten segments gone)
        and execute it as one transaction."""
        key = self.user_key(user_id)
        rewritten = _to_rewrite(current, fresh, drop)
        carried = self._carried(pipe, user_id, current, rewritten) if rewritten else kvfile.UserFile(fresh.layout, {})
        name = new_segment_name()
        entries, segment = next_version(user_id, current, fresh, drop, carried, rewritten, name)
        pipe.multi()
        if not entries:
            pipe.delete(key).srem(self.users_key, user_id)
        else:
            written = None
            if segment.facts:
                data, sha256 = kvfile.encode(user_id, segment)
                pipe.hset(key, name, data)
                written = (name, sha256, len(data))
            index = make_index(user_id, current, fresh.layout, entries, rewritten, written)
            pipe.hset(key, mapping={INDEX_FIELD: index.encode(), EPOCH_FIELD: index.epoch})
            if rewritten:
                pipe.hdel(key, *rewritten)
            pipe.sadd(self.users_key, user_id)
        pipe.execute()

    def _carried(self, pipe, user_id: str, current: UserIndex, names: list[str]) -> kvfile.UserFile:
        """The facts of the segments a write rewrites, read under the watch. A segment gone
        because another writer committed (and compacted) since ``current`` was read is a lost
        race, retried like any other; one gone while ``current`` is still the user's version
        is damage."""
        import redis

        key = self.user_key(user_id)
        blobs = pipe.hmget(key, names)
        if any(blob is None for blob in blobs):
            now = pipe.hget(key, EPOCH_FIELD)
            if now is None or now.decode() != current.epoch:
                raise redis.exceptions.WatchError(f"user {user_id!r} changed while its segments were read")
            raise CorruptDataError(f"{self.describe()}: user {user_id!r}: a segment the index lists is missing")
        where = f"{self.describe()} user {user_id!r}"
        return join_segments(current, {n: decode_segment(current, n, b, f"{where} {n}") for n, b in zip(names, blobs)})


def _to_rewrite(current: UserIndex | None, fresh: kvfile.UserFile, drop: set[str]) -> list[str]:
    """The segments a write rewrites (:func:`~inferscale.storage.format.compaction.segments_to_rewrite`)."""
    if current is None:
        return []
    holding = {current.facts[f].segment for f in drop if f in current.facts}
    new_bytes = sum(kv.nbytes for kv in fresh.facts.values())
    return segments_to_rewrite(current.segment_kv_bytes(), holding, new_bytes, converts(current, fresh))
