"""The Composer interface: retrieved facts → the memory segment's order."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

from inferscale.facts import Hit


class Composer(ABC):
    """Orders retrieved facts in the memory segment ``[instruction prefix | facts]``.

    The segment itself is built by :func:`inferscale.compose.segment.compose_segment`;
    a composer only decides which facts go in and in what order.
    """

    name: ClassVar[str]

    @abstractmethod
    def order(self, hits: Sequence[Hit]) -> list[str]:
        """fact_ids in segment order (first = right after the prefix)."""
