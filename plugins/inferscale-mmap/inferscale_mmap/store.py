"""A memory tier whose users' K/V live in memory-mapped files instead of anonymous memory.

Each user's facts are packed into one buffer, as in the built-in ``pinned`` tier (which this
tier extends: the same bookkeeping, budget, eviction and gather), but the buffer is a shared
mapping of a file in ``directory``. Its pages belong to the page cache, not to the engine's
heap: under memory pressure the kernel writes them back to the file and reads them in again on
use, instead of the process growing or being killed; on a tmpfs or a fast local disk that costs
little. The file is unlinked as soon as it is mapped, so a crash leaves nothing behind, and its
space is freed when the last block of the user is released.

The blocks are not page-locked: the fused write copies them to the GPU first (``pinned`` false).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from inferscale.storage.pinned import PinnedHostStore


class MappedFileStore(PinnedHostStore):
    """Facts' K/V packed per user in memory-mapped, unlinked files under ``directory``."""

    name: ClassVar[str] = "mmap"

    @dataclass(frozen=True)
    class Options(PinnedHostStore.Options):
        #: where the mapped files are made (None: a new temporary directory)
        directory: str | None = None

        def __post_init__(self):
            super().__post_init__()
            if self.directory is not None and (not isinstance(self.directory, str) or not self.directory):
                raise ValueError(f"directory must be a non-empty path string or None, got {self.directory!r}")

    def __init__(self, options: Options | None = None, **runtime: Any):
        options = options or self.Options()
        super().__init__(options, **runtime)
        self.pinned = False  # mapped file pages are never page-locked
        self.directory = options.directory or tempfile.mkdtemp(prefix="inferscale-mmap-")
        os.makedirs(self.directory, exist_ok=True)

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A shared mapping of a new file of ``numel`` elements, unlinked once mapped."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        path = os.path.join(self.directory, f"{uuid.uuid4().hex}.kv")
        try:
            return torch.from_file(path, shared=True, size=numel, dtype=dtype)
        finally:
            if os.path.exists(path):
                os.unlink(path)
