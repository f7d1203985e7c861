"""Reading a user's K/V segments against their index, and laying out the next version.

Reading verifies each segment whole (its own checksum, :func:`kvfile.decode`)
and against the index: the checksum the index recorded for it, the facts the
index places in it, their token ids, the layout. A write (:func:`next_version`)
puts the facts it adds, and the live facts of the segments it rewrites, into
one new segment, and gives the user a new epoch. A write of facts kept in another form than the
user's (``Config.kv_dtype_at_rest`` changed since) converts the user: every segment is rewritten,
in the new facts' form (:func:`converts`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from pathlib import Path

from inferscale.errors import CorruptDataError
from inferscale.kv_fp8 import at_rest
from inferscale.storage.format import kvfile
from inferscale.storage.format.index import FactEntry, SegmentInfo, UserIndex, new_epoch


def read_segments(index: UserIndex, paths: Mapping[str, Path]) -> kvfile.UserFile:
    """The facts (K/V, embeddings) of the segments ``paths`` names (name → file), verified.

    A segment that vanished raises FileNotFoundError (a writer replaced it
    since the index was read: read the index again).
    """
    return join_segments(index, {name: decode_segment(index, name, path.read_bytes(), str(path))
                                 for name, path in paths.items()})


def decode_segment(index: UserIndex, name: str, data: bytes, where: str) -> kvfile.UserFile:
    """Segment ``name``'s bytes (from a file, or a networked store), verified whole and against
    the index; any defect raises CorruptDataError naming ``where``."""
    segment = kvfile.decode(data, index.user_id, where)
    _check_against_index(index, name, segment, where)
    return segment


def join_segments(index: UserIndex, segments: Mapping[str, kvfile.UserFile]) -> kvfile.UserFile:
    """The facts (K/V, embeddings) of verified segments, as one."""
    out = kvfile.UserFile(index.layout, {})
    for segment in segments.values():
        out.facts.update(segment.facts)
        out.embeddings.update(segment.embeddings)
    return out


def _check_against_index(index: UserIndex, name: str, segment: kvfile.UserFile, path: str) -> None:
    expected = index.facts_in(name)
    if segment.sha256 != index.segments[name].sha256 or set(segment.facts) != set(expected):
        raise CorruptDataError(f"{path}: does not match the user's index (replaced or altered)")
    if segment.layout != index.layout:
        raise CorruptDataError(f"{path}: layout {segment.layout.describe()} differs from the index's")
    for fact_id in expected:
        if segment.facts[fact_id].token_ids != index.facts[fact_id].token_ids:
            raise CorruptDataError(f"{path}: token ids of {fact_id!r} differ from the index's")


def next_version(user_id: str, current: UserIndex | None, fresh: kvfile.UserFile, drop: Collection[str],
                 carried: kvfile.UserFile, rewritten: Iterable[str], segment_name: str
                 ) -> tuple[dict[str, FactEntry], kvfile.UserFile]:
    """The next fact entries (insertion order) and the new segment's contents.

    ``fresh`` holds the facts added (a fact already stored is replaced, in
    place); ``drop`` the facts removed; ``carried`` the facts read from the
    ``rewritten`` segments, which move to the new segment unless dropped (kept in ``fresh``'s form).
    """
    rewritten = set(rewritten)
    entries: dict[str, FactEntry] = {}
    for fact_id, entry in (current.facts.items() if current else ()):
        if fact_id in fresh.facts:
            entries[fact_id] = _fresh_entry(fresh, fact_id, segment_name)
        elif fact_id in drop:
            continue
        elif entry.segment in rewritten:
            entries[fact_id] = FactEntry(segment_name, entry.token_ids, entry.record)
        else:
            entries[fact_id] = entry
    for fact_id in fresh.facts:
        entries.setdefault(fact_id, _fresh_entry(fresh, fact_id, segment_name))
    moved = [f for f, e in entries.items() if e.segment == segment_name]
    source = {f: fresh if f in fresh.facts else carried for f in moved}  # a replaced fact is replaced whole
    segment = kvfile.UserFile(fresh.layout, {f: at_rest(source[f].facts[f], fresh.layout.at_rest) for f in moved},
                              embeddings={f: source[f].embeddings[f] for f in moved if f in source[f].embeddings})
    return entries, segment


def converts(current: UserIndex | None, fresh: kvfile.UserFile) -> bool:
    """Whether a write of ``fresh`` keeps the user's facts in another form than ``current``'s
    (then every segment is rewritten in the new one)."""
    return current is not None and current.layout.at_rest != fresh.layout.at_rest


def _fresh_entry(fresh: kvfile.UserFile, fact_id: str, segment_name: str) -> FactEntry:
    return FactEntry(segment_name, fresh.facts[fact_id].token_ids, fresh.records.get(fact_id))


def make_index(user_id: str, current: UserIndex | None, layout, entries: dict[str, FactEntry],
               rewritten: Iterable[str], new_segment: tuple[str, str, int] | None) -> UserIndex:
    """The index after a write: the untouched segments, then the new one (name, sha256, bytes)."""
    rewritten = set(rewritten)
    segments = {n: s for n, s in (current.segments.items() if current else ()) if n not in rewritten}
    if new_segment is not None:
        name, sha256, nbytes = new_segment
        segments[name] = SegmentInfo(sha256, nbytes)
    return UserIndex(user_id, new_epoch(), layout, entries, segments)
