"""How the disk store writes (:class:`~inferscale.storage.disk.DiskStore` inherits this):
under an exclusive lock, one new segment then the index per commit (the index's rename is
the commit), and the removal of what crashed or superseded writes left behind.
"""

from __future__ import annotations

import contextlib
import glob
import shutil
from collections.abc import Iterator
from pathlib import Path

from inferscale.errors import CorruptDataError
from inferscale.facts import user_file_stem
from inferscale import files
from inferscale.storage.format import kvfile
from inferscale.storage.format.compaction import segments_to_rewrite
from inferscale.storage.format.index import INDEX_NAME, UserIndex, new_segment_name
from inferscale.storage.format.segments import converts, make_index, next_version, read_segments

SUFFIX = ".safetensors"
LOCK_NAME = ".lock"


class DiskWrites:
    """The writing half of the disk store; the store provides ``root``, ``user_dir``,
    ``legacy_path``, ``_segment_path`` and ``_index``."""

    root: Path

    @contextlib.contextmanager
    def _writer(self) -> Iterator[None]:
        """Exclusive across threads and processes sharing ``root``."""
        with files.exclusive_lock(self.root / LOCK_NAME):
            yield

    def _commit(self, user_id: str, current: UserIndex | None, fresh: kvfile.UserFile, drop: set[str]) -> None:
        """Write the next version: one new segment (if it holds anything), then the index."""
        rewritten = self._to_rewrite(current, fresh, drop)
        try:
            carried = read_segments(current, {n: self._segment_path(current, n) for n in rewritten}) \
                if rewritten else kvfile.UserFile(fresh.layout, {})
        except FileNotFoundError as exc:
            raise CorruptDataError(f"{self.user_dir(user_id)}: a segment the index lists is missing "
                                   f"({Path(exc.filename or '?').name})") from None
        name = new_segment_name()
        entries, segment = next_version(user_id, current, fresh, drop, carried, rewritten, name)
        if not entries:
            self._remove_user(user_id)
            return
        files.make_dir(self.user_dir(user_id))
        written = self._write_segment(user_id, name, segment) if segment.facts else None
        index = make_index(user_id, current, fresh.layout, entries, rewritten, written)
        files.atomic_write(self.user_dir(user_id) / INDEX_NAME, index.encode())
        for old in rewritten:
            files.remove(self._segment_path(current, old))
        self._sync_after_removal(user_id, current)

    @staticmethod
    def _to_rewrite(current: UserIndex | None, fresh: kvfile.UserFile, drop: set[str]) -> list[str]:
        if current is None:
            return []
        holding = {current.facts[f].segment for f in drop if f in current.facts}
        new_bytes = sum(kv.nbytes for kv in fresh.facts.values())
        return segments_to_rewrite(current.segment_kv_bytes(), holding, new_bytes,
                                   current.legacy or converts(current, fresh))

    def _write_segment(self, user_id: str, name: str, segment: kvfile.UserFile) -> tuple[str, str, int]:
        data, sha256 = kvfile.encode(user_id, segment)
        files.atomic_write(self.user_dir(user_id) / name, data)
        return name, sha256, len(data)

    def _sync_after_removal(self, user_id: str, current: UserIndex | None) -> None:
        files.fsync_dir(self.user_dir(user_id))
        if current is not None and current.legacy:
            files.fsync_dir(self.root)

    def _remove_user(self, user_id: str) -> None:
        """Remove the format 1/2 file, then the index (the commit), then the rest."""
        if files.remove(self.legacy_path(user_id)):
            files.fsync_dir(self.root)
        directory = self.user_dir(user_id)
        if files.remove(directory / INDEX_NAME):
            files.fsync_dir(directory)
        if directory.is_dir():
            shutil.rmtree(directory)
            files.fsync_dir(directory.parent)

    def _clean(self, user_id: str) -> UserIndex | None:
        """The user's current index, after removing what crashed or superseded writes
        left behind (we hold the write lock)."""
        index = self._index(user_id)
        self._remove_temps(user_id)
        directory = self.user_dir(user_id)
        if index is not None and not index.legacy and files.remove(self.legacy_path(user_id)):
            files.fsync_dir(self.root)  # a format 1/2 file left by a crash right after its conversion
        if directory.is_dir():
            live = set() if index is None or index.legacy else set(index.segments)
            for path in directory.iterdir():
                if path.name != INDEX_NAME and path.name not in live:
                    files.remove(path)
        return index

    def _remove_temps(self, user_id: str) -> None:
        """Temp files of the format 1/2 writer that a crash left in the root."""
        pattern = glob.escape(f".{user_file_stem(user_id)}{SUFFIX}") + "#*" + files.TEMP_SUFFIX
        for stale in self.root.glob(pattern):
            files.remove(stale)
