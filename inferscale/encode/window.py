"""Window policies: what a fact is encoded behind.

A fact's K/V depends on what the model saw before it. A policy picks that
context: a window of the conversation the fact came from (the turns before
it), or the facts stored before it, rendered as they are read in the memory
segment (a list of facts after the instruction).
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
    from (None when unknown). ``previous_facts`` are the token ids of the
    user's facts given before this one (oldest first), each as it reads in the
    memory segment. The encoder puts the instruction prefix before the context.
    """

    name: ClassVar[str]

    @abstractmethod
    def context_ids(self, turns: Sequence[Turn], source: int | None, tokenize: Tokenize,
                    previous_facts: Sequence[Sequence[int]] = ()) -> list[int]: ...
