"""Window policies: which preceding conversation a fact is encoded behind.

A fact's K/V depends on what the model saw before it. Encoding each fact behind
a window of its source conversation (context-window encoding) gives K/V closer
to what the model would compute with that context in the prompt.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Turn:
    """One conversation turn; ``turn_id`` is e.g. LoCoMo's dia_id ``"D1:3"``."""

    turn_id: str
    speaker: str
    text: str

    def render(self) -> str:
        return f"{self.speaker}: {self.text}\n"


Tokenize = Callable[[str], list[int]]


class WindowPolicy(ABC):
    """Chooses the context token ids a fact is encoded behind.

    ``source`` is the index in ``turns`` of the turn the fact was extracted
    from (None when unknown). The window ends at that turn, inclusive.
    """

    name: ClassVar[str]

    @abstractmethod
    def context_ids(self, turns: Sequence[Turn], source: int | None, tokenize: Tokenize) -> list[int]: ...
