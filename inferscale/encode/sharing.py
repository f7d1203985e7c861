"""Which tokens the encoder prefills once and shares: the plan, in plain Python.

Every row is ``[context | fact]``, and a fact keeps only its own K/V. Under
causal attention the K/V of a token depend on the tokens before it and on
nothing after, so rows that start with the same tokens can share those
tokens' K/V exactly. The plan shares two things:

* the **base**: the longest prefix common to every row's context (at least
  the instruction prefix), prefilled once per call;
* **hosts**: contexts (past the base) that are equal, or one a prefix of
  another, are prefilled once, as the longest of them. Equal:
  the facts of one source turn under the "turns" and "tokens" windows.
  Nested: the first facts of a conversation under "turns" (windows clipped
  at its first turn) and "facts" (each fact's context is the one before it
  plus one fact), and a "tokens" window that reaches the first turn.

A fact then runs against the first ``len(context)`` tokens of its host's
K/V, at positions ``len(context)`` onward: the same tokens at the same
positions as a whole-row prefill, so the same K/V up to float rounding.

Hosts are prefilled up to ``batch_size`` at a time, longest first (little
padding), and their facts follow ``batch_size`` at a time: no forward pass
runs more than ``batch_size`` rows, and no host is prefilled twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One sequence to run: ``context`` ids, then the ``ids`` whose K/V we keep."""

    context: tuple[int, ...]
    ids: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.context) + len(self.ids)


@dataclass(frozen=True)
class Chunk:
    """Hosts prefilled in one pass (past the base), and the rows encoded against them."""

    hosts: tuple[tuple[int, ...], ...]
    rows: tuple[int, ...]  # indices of the rows, longest fact first
    host_of: tuple[int, ...]  # for each of ``rows``, its host's index in ``hosts``


@dataclass(frozen=True)
class Plan:
    base: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    def tokens(self, rows: Sequence[Row]) -> int:
        """Tokens prefilled, padding aside: the base once, every host once, every fact."""
        hosts = sum(len(h) for chunk in self.chunks for h in chunk.hosts)
        return len(self.base) + hosts + sum(len(row.ids) for row in rows)


def common_prefix_length(seqs: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every sequence starts with (0 for none)."""
    if not seqs:
        return 0
    first, n = seqs[0], min(len(s) for s in seqs)
    for seq in seqs[1:]:
        n = next((i for i in range(n) if seq[i] != first[i]), n)
    return n


def nest(seqs: Sequence[tuple[int, ...]]) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """``(hosts, host_of)``: the sequences that are a prefix of no other, longest first,
    and for each of ``seqs`` the index of a host that starts with it.

    Sorted in reverse, a sequence's extensions come right before it, so it is
    a prefix of some sequence exactly when it is a prefix of the host of the
    one just before it.
    """
    host_index: dict[tuple[int, ...], tuple[int, ...]] = {}
    host: tuple[int, ...] | None = None
    for seq in sorted(set(seqs), reverse=True):
        if host is None or host[: len(seq)] != seq:
            host = seq
        host_index[seq] = host
    hosts = tuple(sorted(set(host_index.values()), key=lambda h: (-len(h), h)))
    position = {h: i for i, h in enumerate(hosts)}
    return hosts, tuple(position[host_index[seq]] for seq in seqs)


def plan(rows: Sequence[Row], batch_size: int) -> Plan:
    """The base, and the hosts (longest first) in chunks: at most ``batch_size`` hosts
    with at most ``batch_size`` rows between them, or one host with more."""
    base = common_prefix_length([row.context for row in rows])
    hosts, host_of = nest([row.context[base:] for row in rows])
    members: list[list[int]] = [[] for _ in hosts]
    for i, h in enumerate(host_of):
        members[h].append(i)
    groups = _groups([len(m) for m in members], batch_size)
    return Plan(rows[0].context[:base] if rows else (), tuple(_chunk(rows, hosts, members, g) for g in groups))


def _groups(sizes: Sequence[int], batch_size: int) -> list[list[int]]:
    """Consecutive indices in groups of at most ``batch_size`` whose sizes add up to at
    most ``batch_size`` (an index whose size alone is larger makes a group of its own)."""
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not groups or len(groups[-1]) == batch_size or total + size > batch_size:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


def _chunk(rows: Sequence[Row], hosts, members: Sequence[Sequence[int]], group: Sequence[int]) -> Chunk:
    """The group's hosts, and their rows longest fact first (little padding)."""
    pairs = sorted(((i, k) for k, h in enumerate(group) for i in members[h]), key=lambda p: -len(rows[p[0]].ids))
    return Chunk(tuple(hosts[h] for h in group), tuple(i for i, _ in pairs), tuple(k for _, k in pairs))
