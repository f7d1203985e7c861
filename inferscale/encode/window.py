"""Window policies: what a fact is encoded behind.

A fact's K/V depends on what the model saw before it. A policy picks that
context: a window of the conversation the fact came from (the turns before
it), the facts stored before it, or the facts most related to it (the ones it
is most likely retrieved with), rendered as they are read in the memory
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
    memory segment. ``related_facts`` are those of the user's facts most
    related to this one (the most related last), given only to a policy whose
    ``related`` is the number it wants: the caller ranks them (by the
    retrieval embedder). The encoder puts the instruction prefix before the
    context.
    """

    name: ClassVar[str]
    #: how many related facts the policy reads (0: none, and the caller ranks none)
    related: int = 0

    @abstractmethod
    def context_ids(self, turns: Sequence[Turn], source: int | None, tokenize: Tokenize,
                    previous_facts: Sequence[Sequence[int]] = (),
                    related_facts: Sequence[Sequence[int]] = ()) -> list[int]: ...
