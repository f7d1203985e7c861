"""A user's index (format 3; 4 for a user kept in fp8): everything about their facts except the K/V.

``<root>/users/<user_id>/index.json`` lists the user's facts in insertion
order — token ids, record (text, source turn) and the segment file holding
their K/V — the segments with their checksums, the layout, and the
*epoch*: a random id renewed on every write. It is small, so the
scheduler reads it (and verifies its own checksum) without touching any K/V;
the K/V segments are verified when they are read (``docs/storage-format.md``).

Why the epoch is a random id (:mod:`inferscale.compose.salt`):
it changes on every write (add, update, delete, re-encode), it is never
reused (128 random bits), and it needs no record that outlives the user — a
user deleted and created again gets a new one, so no salt issued before the
deletion ever matches again.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from inferscale.errors import CorruptDataError
from inferscale.facts import check_id, same_user
from inferscale.kv import token_ids_valid
from inferscale.storage.layout import KVLayout

FORMAT = "inferscale-kv-index"
VERSION = "3"
#: the version of a user kept in fp8 (its layout names ``at_rest``: older readers refuse it clearly)
FP8_VERSION = "4"
INDEX_NAME = "index.json"
CHECKSUM_KEY = "sha256"
_SEGMENT_NAME = re.compile(r"^seg-[0-9a-f]{32}\.safetensors$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


#: the index's JSON key for the epoch: "generation", the name it was written under
#: (kept so that existing index files stay readable and the format stays 3)
EPOCH_KEY = "generation"


def new_epoch() -> str:
    return secrets.token_hex(16)


def new_segment_name() -> str:
    return f"seg-{secrets.token_hex(16)}.safetensors"


@dataclass(frozen=True)
class SegmentInfo:
    """A K/V segment file as the index knows it: its checksum and size."""

    sha256: str
    nbytes: int


@dataclass(frozen=True)
class FactEntry:
    """One fact: where its K/V live, its token ids, its record (text, source turn) if any."""

    segment: str
    token_ids: tuple[int, ...]
    record: Mapping[str, str | None] | None = None


@dataclass(frozen=True)
class UserIndex:
    user_id: str
    epoch: str
    layout: KVLayout
    facts: Mapping[str, FactEntry]  # insertion order
    segments: Mapping[str, SegmentInfo]  # oldest first
    version: str = VERSION

    @property
    def legacy(self) -> bool:
        """True for a format 1/2 file read as an index (one segment: the file itself)."""
        return self.version not in (VERSION, FP8_VERSION)

    @property
    def token_ids(self) -> dict[str, tuple[int, ...]]:
        return {f: e.token_ids for f, e in self.facts.items()}

    @property
    def records(self) -> dict[str, Mapping]:
        return {f: e.record for f, e in self.facts.items() if e.record is not None}

    @property
    def nbytes(self) -> int:
        """Bytes of K/V (not of the files), in the form they are kept in."""
        return self.layout.nbytes(len(e.token_ids) for e in self.facts.values())

    def segment_kv_bytes(self) -> dict[str, int]:
        """Bytes of K/V in each segment (oldest first)."""
        lengths: dict[str, list[int]] = {name: [] for name in self.segments}
        for entry in self.facts.values():
            lengths[entry.segment].append(len(entry.token_ids))
        return {name: self.layout.nbytes(n) for name, n in lengths.items()}

    def facts_in(self, segment: str) -> list[str]:
        return [f for f, e in self.facts.items() if e.segment == segment]

    def encode(self) -> bytes:
        body = self._body()
        body[CHECKSUM_KEY] = checksum(body)
        return canonical(body)

    def _body(self) -> dict:
        return {
            "format": FORMAT,
            "format_version": FP8_VERSION if self.layout.fp8 else VERSION,
            "user_id": self.user_id,
            EPOCH_KEY: self.epoch,
            "layout": self.layout.to_dict(),
            "segments": [{"name": n, "sha256": s.sha256, "bytes": s.nbytes} for n, s in self.segments.items()],
            "facts": [_fact_json(f, e) for f, e in self.facts.items()],
        }

    @classmethod
    def decode(cls, data: bytes, user_id: str, where: str) -> UserIndex:
        """Parse and verify an index file's bytes; any defect raises CorruptDataError naming ``where``
        (nesting too deep for Python's parser included: it is a defect of the file, not of the reader)."""
        try:
            return cls._decode(data, user_id, where)
        except RecursionError:
            raise CorruptDataError(f"{where}: not a readable index (nested too deeply)") from None

    @classmethod
    def _decode(cls, data: bytes, user_id: str, where: str) -> UserIndex:
        try:
            body = json.loads(data)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            raise CorruptDataError(f"{where}: not a readable index ({exc})") from exc
        _check_header(body, user_id, where)
        if body.get(CHECKSUM_KEY) != checksum({k: v for k, v in body.items() if k != CHECKSUM_KEY}):
            raise CorruptDataError(f"{where}: index checksum mismatch (the file was altered or damaged)")
        try:
            segments = _segments(body["segments"])
            layout = KVLayout.from_dict(body["layout"])
            if layout.fp8 != (body["format_version"] == FP8_VERSION):
                raise ValueError(f"format_version {body['format_version']} with K/V {layout.describe()}")
            return cls(user_id, _epoch(body[EPOCH_KEY]), layout, _facts(body["facts"], segments), segments,
                       body["format_version"])
        except (ValueError, TypeError, KeyError) as exc:
            raise CorruptDataError(f"{where}: inconsistent index ({exc})") from exc


def canonical(body: Mapping) -> bytes:
    """The bytes an index is stored as, and its checksum is taken over: JSON,
    keys sorted, no whitespace, ASCII (non-ASCII as ``\\uXXXX``)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def checksum(body: Mapping) -> str:
    """SHA-256 (hex) of the canonical JSON of the index without its ``sha256`` key."""
    return hashlib.sha256(canonical(body)).hexdigest()


def _fact_json(fact_id: str, entry: FactEntry) -> dict:
    out = {"id": fact_id, "segment": entry.segment, "token_ids": list(entry.token_ids)}
    if entry.record is not None:
        out.update(text=entry.record["text"], source_turn=entry.record.get("source_turn"))
    return out


def _check_header(body: Mapping, user_id: str, where: str) -> None:
    if body.get("format") != FORMAT:
        raise CorruptDataError(f"{where}: not an {FORMAT} file (format={body.get('format')!r})")
    if body.get("format_version") not in (VERSION, FP8_VERSION):
        raise CorruptDataError(f"{where}: unsupported index format_version {body.get('format_version')!r} "
                               f"(this version reads {VERSION} and {FP8_VERSION})")
    missing = {"user_id", EPOCH_KEY, "layout", "segments", "facts", CHECKSUM_KEY} - set(body)
    if missing:
        raise CorruptDataError(f"{where}: index lacks {sorted(missing)}")
    if not same_user(body["user_id"], user_id):
        raise CorruptDataError(f"{where}: holds user {body['user_id']!r}, expected {user_id!r}")


def _epoch(value) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{32}", value):
        raise ValueError(f"bad epoch {value!r}")
    return value


def _segments(items) -> dict[str, SegmentInfo]:
    out = {}
    for item in items:
        name, sha, size = item["name"], item["sha256"], item["bytes"]
        if not isinstance(name, str) or not _SEGMENT_NAME.match(name) or name in out:
            raise ValueError(f"bad or repeated segment name {name!r}")
        if not isinstance(sha, str) or not _HEX64.match(sha) or not isinstance(size, int) or size < 0:
            raise ValueError(f"segment {name}: bad checksum or size")
        out[name] = SegmentInfo(sha, size)
    return out


def _facts(items, segments: Mapping[str, SegmentInfo]) -> dict[str, FactEntry]:
    out = {}
    for item in items:
        fact_id = check_id(item["id"], "fact_id")
        if fact_id in out or item["segment"] not in segments:
            raise ValueError(f"fact {fact_id!r} is repeated or names an unknown segment")
        ids = item["token_ids"]
        if not isinstance(ids, list) or not token_ids_valid(ids):
            raise ValueError(f"fact {fact_id!r}: token_ids must be a list of integers in 0..2**63-1")
        out[fact_id] = FactEntry(item["segment"], tuple(ids), _record(item))
    if set(segments) - {e.segment for e in out.values()}:
        raise ValueError("a segment holds no fact")
    return out


def _record(item: Mapping) -> dict | None:
    if "text" not in item:
        return None
    text, turn = item["text"], item.get("source_turn")
    if not isinstance(text, str) or not (turn is None or isinstance(turn, str)):
        raise ValueError(f"fact {item['id']!r}: bad record")
    return {"text": text, "source_turn": turn}
