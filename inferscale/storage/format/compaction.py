"""Which of a user's segment files a write rewrites.

A write appends its facts as one new segment file and rewrites only:

* the segments holding a fact it removes or replaces, so a deleted fact's
  bytes leave the disk with the write that deletes it (no file ever holds a
  fact the index does not list);
* the newest segments that are not larger than what is being written, merged
  into the new one. Sizes then at least double from the newest segment to the
  oldest, as in a binary counter: a user of n facts has O(log n) segments,
  and each byte is rewritten O(log n) times however the facts arrive;
* every segment of a format 1/2 file (its first write converts it), and every segment of a user
  whose facts a write keeps in another form (``Config.kv_dtype_at_rest`` changed: the write
  converts them, :func:`~inferscale.storage.format.segments.next_version`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def segments_to_rewrite(sizes: Mapping[str, int], holding_dropped: Collection[str], new_bytes: int,
                        every: bool = False) -> list[str]:
    """The segments (oldest first, from ``sizes``: name → bytes of K/V) a write of
    ``new_bytes`` of K/V that drops facts from ``holding_dropped`` rewrites (``every``: all of them,
    a conversion)."""
    if every:
        return list(sizes)
    rewrite = set(holding_dropped)
    carried = new_bytes + sum(sizes[name] for name in rewrite)
    for name in reversed(list(sizes)):
        if name in rewrite:
            continue
        if sizes[name] > carried:
            break
        rewrite.add(name)
        carried += sizes[name]
    return [name for name in sizes if name in rewrite]

