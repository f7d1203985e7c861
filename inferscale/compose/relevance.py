"""The built-in composer: order facts by retrieval score."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from inferscale.compose.base import Composer
from inferscale.facts import Hit


class RelevanceComposer(Composer):
    """Facts ordered by relevance; by default the most relevant fact comes last,
    closest to the question."""

    name = "relevance"

    @dataclass(frozen=True)
    class Options:
        most_relevant: Literal["last", "first"] = "last"

        def __post_init__(self):
            if self.most_relevant not in ("last", "first"):
                raise ValueError(f"most_relevant must be 'last' or 'first', got {self.most_relevant!r}")

    def __init__(self, options: Options | None = None):
        self.options = options or self.Options()

    def order(self, hits: Sequence[Hit]) -> list[str]:
        ranked = sorted(hits, key=lambda h: (-h.score, h.fact_id))
        ids = [h.fact_id for h in ranked]
        return ids[::-1] if self.options.most_relevant == "last" else ids
