"""A composer that keeps only facts whose retrieval score reaches a threshold."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferscale.compose.base import Composer
from inferscale.facts import Hit


class ThresholdComposer(Composer):
    name = "threshold"

    @dataclass(frozen=True)
    class Options:
        min_score: float = 0.3
        max_facts: int | None = None

        def __post_init__(self):
            if self.max_facts is not None and self.max_facts < 0:
                raise ValueError(f"max_facts must be >= 0, got {self.max_facts}")

    def __init__(self, options: Options | None = None):
        self.options = options or self.Options()

    def order(self, hits: Sequence[Hit]) -> list[str]:
        kept = sorted((h for h in hits if h.score >= self.options.min_score), key=lambda h: (-h.score, h.fact_id))
        if self.options.max_facts is not None:
            kept = kept[: self.options.max_facts]
        return [h.fact_id for h in reversed(kept)]  # most relevant last, next to the question
