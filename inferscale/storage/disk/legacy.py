"""Files of formats 1 and 2 (``<root>/<user_id>.safetensors``, one file per user), read as an index.

Their index — fact ids, token ids, records, layout, checksum — is read from
the safetensors header and the small ``token_ids`` tensors, never the K/V.
The checksum covers every byte, so it cannot be verified without the K/V:
the token ids read here are unverified, and the K/V read (the worker's, when
it injects) verifies the whole file, header included, so a damaged header can
cause a fallback, never wrong K/V. The first
write to such a user converts it to format 3 (:class:`~inferscale.storage.disk.DiskStore`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from safetensors import safe_open

from inferscale.errors import CorruptDataError
from inferscale.storage.format import kvfile
from inferscale.files import identity
from inferscale.storage.format.index import FactEntry, SegmentInfo, UserIndex
from inferscale.storage.layout import KVLayout


def read_index(path: Path, user_id: str) -> UserIndex:
    """The file's index (raises FileNotFoundError, or CorruptDataError naming ``path``)."""
    stat = os.stat(path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            metadata = fh.metadata() or {}
            kvfile.check_header(metadata, user_id, str(path))
            fact_ids = json.loads(metadata["fact_ids"])
            records = kvfile.check_records(json.loads(metadata.get("records", "{}")), fact_ids)
            token_ids = {f: tuple(fh.get_tensor(kvfile.tensor_name(f, "token_ids")).tolist()) for f in fact_ids}
        layout = KVLayout.from_dict(json.loads(metadata["layout"]))
        facts = {f: FactEntry(path.name, token_ids[f], records.get(f)) for f in fact_ids}
    except (CorruptDataError, FileNotFoundError):
        raise
    except Exception as exc:  # anything unreadable is corrupt, whatever the parser raised
        raise CorruptDataError(f"{path}: not a readable {kvfile.FORMAT} file ({exc})") from exc
    segments = {path.name: SegmentInfo(metadata[kvfile.CHECKSUM_KEY], stat.st_size)}
    return UserIndex(user_id, epoch(stat), layout, facts, segments, metadata["format_version"])


def epoch(stat: os.stat_result) -> str:
    """A legacy file's epoch: derived from its identity (it changes whenever the file is rewritten)."""
    return hashlib.sha256(repr(("legacy", *identity(stat))).encode()).hexdigest()[:32]
