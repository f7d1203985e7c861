"""The on-disk encoding of facts' K/V: a checksummed safetensors file.

In format 3 each file is one *segment* of a user's facts (the user's index,
:mod:`inferscale.storage.format.index`, lists them); in formats 1 and 2 one file held
all of a user's facts (still read, :mod:`inferscale.storage.disk.legacy`). See
``docs/storage-format.md`` for the specification. In short, tensors
``<fact_id>/keys`` and ``<fact_id>/values`` (``[L, T, H, D]``, the user's
dtype), ``<fact_id>/token_ids`` (int64 ``[T]``) and, where the fact has one,
``<fact_id>/embedding`` (float32 ``[dim]``) per fact, and metadata
``format``, ``format_version``, ``user_id``, ``layout``, ``fact_ids``,
``records`` (each fact's text and source turn; empty in a segment, whose
records live in the index) and ``sha256`` (see :func:`checksum`). A segment of a user kept in
fp8 (:mod:`inferscale.kv_fp8`) is format 4: its keys and values are e4m3, each fact has a
``<fact_id>/dequant`` (bfloat16 ``[2, L, H, D + 1]``) and its layout names ``at_rest``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from inferscale.errors import CorruptDataError
from inferscale.facts import same_user
from inferscale.kv import FactKV
from inferscale.kv_fp8 import Fp8KV, check_dequant
from inferscale.storage.layout import KVLayout

FORMAT = "inferscale-kv"
FORMAT_VERSION = "3"
#: the version of a segment kept in fp8 (format 3's, with e4m3 K/V and each fact's dequant)
FP8_VERSION = "4"
#: versions this code reads (version 1 files have no records or embeddings; version 3
#: files are segments, whose records live in the user's index; version 4, segments in fp8)
READABLE_VERSIONS = ("1", "2", "3", "4")
CHECKSUM_KEY = "sha256"
PARTS = ("keys", "values", "token_ids")
#: an fp8 fact's offsets and scales (:attr:`~inferscale.kv_fp8.Fp8KV.dequant`)
DEQUANT = "dequant"
EMBEDDING = "embedding"


@dataclass
class UserFile:
    """Facts of one file (a segment, or a whole user in format 1/2), verified: K/V
    with token ids, and each fact's record (``{"text", "source_turn"}``) and
    embedding where it has them."""

    layout: KVLayout
    facts: dict[str, FactKV | Fp8KV]
    records: dict[str, dict] = field(default_factory=dict)
    embeddings: dict[str, torch.Tensor] = field(default_factory=dict)
    #: the file's checksum (set when decoded)
    sha256: str = ""


def tensor_name(fact_id: str, part: str) -> str:
    """``<fact_id>/<part>``; fact ids never contain ``/``, so names are unambiguous."""
    return f"{fact_id}/{part}"


def checksum(metadata: Mapping[str, str], tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) over the metadata and the tensors, independent of file layout.

    Fed, in order: for each metadata key except ``sha256``, sorted by key,
    ``key NUL value NUL`` (UTF-8); then for each tensor, sorted by name,
    ``name NUL dtype NUL shape NUL`` (dtype as torch names it, e.g.
    ``bfloat16``; shape as comma-separated decimal sizes, empty for a scalar)
    followed by the tensor's raw bytes, C order, little-endian.
    """
    digest = hashlib.sha256()
    for key in sorted(metadata):
        if key != CHECKSUM_KEY:
            digest.update(f"{key}\0{metadata[key]}\0".encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = ",".join(str(s) for s in tensor.shape)
        digest.update(f"{name}\0{dtype}\0{shape}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def encode(user_id: str, user: UserFile) -> tuple[bytes, str]:
    """The file's bytes for a user's facts (all of ``user.layout``), in their order,
    and its checksum."""
    tensors: dict[str, torch.Tensor] = {}
    for fact_id, kv in user.facts.items():
        tensors[tensor_name(fact_id, "keys")] = _owned_cpu(kv.keys)
        tensors[tensor_name(fact_id, "values")] = _owned_cpu(kv.values)
        tensors[tensor_name(fact_id, "token_ids")] = torch.tensor(kv.token_ids, dtype=torch.int64)
        if isinstance(kv, Fp8KV):
            tensors[tensor_name(fact_id, DEQUANT)] = _owned_cpu(kv.dequant)
        if fact_id in user.embeddings:
            tensors[tensor_name(fact_id, EMBEDDING)] = _owned_cpu(user.embeddings[fact_id].to(torch.float32))
    metadata = {
        "format": FORMAT,
        "format_version": FP8_VERSION if user.layout.fp8 else FORMAT_VERSION,
        "user_id": user_id,
        "layout": json.dumps(user.layout.to_dict(), sort_keys=True),
        "fact_ids": json.dumps(list(user.facts)),
        "records": json.dumps({f: user.records[f] for f in user.facts if f in user.records}, sort_keys=True),
    }
    metadata[CHECKSUM_KEY] = checksum(metadata, tensors)
    return st_save(tensors, metadata), metadata[CHECKSUM_KEY]


def decode(data: bytes, user_id: str, where: str) -> UserFile:
    """Parse and verify a file's bytes; any defect raises CorruptDataError naming ``where``."""
    metadata, tensors = _parse(data, where)
    check_header(metadata, user_id, where)
    if metadata[CHECKSUM_KEY] != checksum(metadata, tensors):
        raise CorruptDataError(f"{where}: checksum mismatch (the file was altered or damaged)")
    try:
        layout = KVLayout.from_dict(json.loads(metadata["layout"]))
        if layout.fp8 != (metadata["format_version"] == FP8_VERSION):
            raise ValueError(f"format_version {metadata['format_version']} with K/V {layout.describe()}")
        fact_ids = json.loads(metadata["fact_ids"])
        records = check_records(json.loads(metadata.get("records", "{}")), fact_ids)
        embeddings = _embeddings(tensors, fact_ids)
        return UserFile(layout, _facts(layout, fact_ids, tensors), records, embeddings, metadata[CHECKSUM_KEY])
    except (ValueError, TypeError, KeyError) as exc:
        raise CorruptDataError(f"{where}: inconsistent contents ({exc})") from exc


def read_embeddings(path: str, user_id: str) -> dict[str, torch.Tensor]:
    """The facts' embeddings alone, read without the K/V (the retrieval index's
    rebuild at start-up). The header is checked; the checksum, which needs every
    byte, is left to the reads that return K/V."""
    try:
        with safe_open(path, framework="pt") as fh:
            metadata = fh.metadata() or {}
            check_header(metadata, user_id, path)
            names = set(fh.keys())
            wanted = [f for f in json.loads(metadata["fact_ids"]) if tensor_name(f, EMBEDDING) in names]
            tensors = {tensor_name(f, EMBEDDING): fh.get_tensor(tensor_name(f, EMBEDDING)) for f in wanted}
        return _embeddings(tensors, wanted)
    except (CorruptDataError, FileNotFoundError):
        raise
    except Exception as exc:  # anything unreadable is corrupt, whatever the parser raised
        raise CorruptDataError(f"{path}: embeddings unreadable ({exc})") from exc


def _parse(data: bytes, where: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """Metadata and tensors of a safetensors buffer (8-byte LE length, JSON header, data)."""
    try:
        size = int.from_bytes(data[:8], "little")
        if len(data) < 8 or 8 + size > len(data):
            raise ValueError(f"header of {size} bytes does not fit in {len(data)} bytes")
        header = json.loads(data[8 : 8 + size])
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise ValueError("metadata is not a table")
        tensors = st_load(data)
    except Exception as exc:  # anything unparsable is corrupt, whatever the parser raised
        raise CorruptDataError(f"{where}: not a readable safetensors file ({exc})") from exc
    return metadata, tensors


def check_header(metadata: Mapping[str, str], user_id: str, where: str) -> None:
    if metadata.get("format") != FORMAT:
        raise CorruptDataError(f"{where}: not an {FORMAT} file (format={metadata.get('format')!r})")
    if metadata.get("format_version") not in READABLE_VERSIONS:
        raise CorruptDataError(
            f"{where}: unsupported format_version {metadata.get('format_version')!r} "
            f"(this version reads {', '.join(READABLE_VERSIONS)})"
        )
    missing = {"user_id", "layout", "fact_ids", CHECKSUM_KEY} - set(metadata)
    if missing:
        raise CorruptDataError(f"{where}: metadata lacks {sorted(missing)}")
    if not same_user(metadata["user_id"], user_id):
        raise CorruptDataError(f"{where}: holds user {metadata['user_id']!r}, expected {user_id!r}")


def _embeddings(tensors: dict[str, torch.Tensor], fact_ids: list) -> dict[str, torch.Tensor]:
    """Pop the facts' embedding tensors (float32 vectors of one size)."""
    out = {f: tensors.pop(tensor_name(f, EMBEDDING)) for f in fact_ids if tensor_name(f, EMBEDDING) in tensors}
    if any(e.dim() != 1 or e.dtype != torch.float32 for e in out.values()) or len({e.numel() for e in out.values()}) > 1:
        raise ValueError("embeddings must be float32 vectors of one size")
    return out


def check_records(records, fact_ids: list) -> dict[str, dict]:
    if not isinstance(records, dict) or not set(records) <= set(fact_ids):
        raise ValueError("records name facts the file does not hold")
    for record in records.values():
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError("a record lacks its text")
    return records


def _facts(layout: KVLayout, fact_ids: list, tensors: Mapping[str, torch.Tensor]) -> dict[str, FactKV | Fp8KV]:
    """FactKVs (Fp8KVs in fp8) from verified tensors; ValueError when names, shapes or dtypes
    disagree, or an fp8 fact's dequant or codes are not what a writer makes (:func:`check_dequant`)."""
    parts = (*PARTS, DEQUANT) if layout.fp8 else PARTS
    expected = {tensor_name(f, part) for f in fact_ids for part in parts}
    if len(set(fact_ids)) != len(fact_ids) or expected != set(tensors):
        raise ValueError("tensor names do not match the fact_ids list")
    facts = {}
    for fact_id in fact_ids:
        kv = _fact(layout, {part: tensors[tensor_name(fact_id, part)] for part in parts})
        if KVLayout.of(kv) != layout or tensors[tensor_name(fact_id, "token_ids")].dim() != 1:
            raise ValueError(f"fact {fact_id!r} does not match the layout {layout.describe()}")
        facts[fact_id] = kv
    return facts


def _fact(layout: KVLayout, parts: Mapping[str, torch.Tensor]) -> FactKV | Fp8KV:
    token_ids = parts["token_ids"].tolist()
    if not layout.fp8:
        return FactKV(token_ids, parts["keys"], parts["values"])
    kv = Fp8KV(token_ids, parts["keys"], parts["values"], parts[DEQUANT], layout.dtype)
    check_dequant(kv.dequant, kv.keys, kv.values)
    return kv


def _owned_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy that shares storage with nothing (safetensors requires it)."""
    out = torch.empty(tensor.shape, dtype=tensor.dtype)
    out.copy_(tensor.detach())
    return out
