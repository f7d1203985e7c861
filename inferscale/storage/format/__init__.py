"""A user as a store of record keeps them (format 3, docs/storage-format.md), shared by the disk
and Redis stores: ``index.py`` (the user's index: facts, token ids, records, segments, epoch),
``kvfile.py`` (a checksummed safetensors segment of K/V and embeddings), ``segments.py`` (reading
segments against the index, laying out the next version), ``compaction.py`` (which segments a
write rewrites), ``reads.py`` (every read that follows from the index: list, token ids, records,
a whole user), ``index_cache.py`` (parsed indexes, bounded in bytes), ``nfc_names.py`` (users
stored under a non-NFC id, renamed)."""
