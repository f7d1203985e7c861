"""The built-in window policies: "facts", "neighbours", "turns", "tokens" and "none".

"facts" (the default) encodes each fact behind the facts stored before it, so
the fact is encoded as it will be read: one item in a list of facts after the
instruction. On LoCoMo (Qwen2.5-Coder-0.5B, 1,035 questions) this lifts KV
injection's F1 from 0.155 to 0.233 at k = 5, level with prompt injection's
0.216, where a window of conversation turns leaves it far behind
(benchmarks/results/locomo_qwen05_h200.md).

"turns" and "tokens" pick the conversation a fact is encoded behind (the
paper's context-window encoding). Their window always ends at the fact's
source turn, **inclusive**: the turn the fact was extracted from is the most
relevant context (it holds the words the fact paraphrases), and the fact is
encoded right after it. A fact with no known source turn gets no context
(w = 0) from these two.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from inferscale.encode.window import Tokenize, Turn, WindowPolicy


def _last_facts(facts: Sequence[Sequence[int]], window: int) -> list[int]:
    """The token ids of the last ``window`` facts, in order (none for a window of 0)."""
    return [t for fact in facts[-window:] for t in fact] if window else []


def _turn_ids(turns: Sequence[Turn], tokenize: Tokenize) -> list[int]:
    return [t for turn in turns for t in tokenize(turn.render())]


def _counted(default: int, what: str) -> type:
    """The Options of a policy whose window counts ``what`` (an integer >= 0)."""

    @dataclass(frozen=True)
    class Options:
        window: int = default

        def __post_init__(self):
            if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
                raise ValueError(f"window ({what}) must be an integer >= 0, got {self.window!r}")

    return Options


class _CountedWindow(WindowPolicy):
    Options: ClassVar[type]

    def __init__(self, options=None, **runtime):
        self.options = options or self.Options()


class TurnsWindow(_CountedWindow):
    """The ``window`` turns ending at the source turn, inclusive.

    ``window=1`` is the source turn alone; ``window=2`` adds the turn before
    it (typically the other speaker's), and so on. ``window=0`` is no context.
    """

    name = "turns"
    Options = _counted(2, "turns")

    def context_ids(self, turns: Sequence[Turn], source: int | None, tokenize: Tokenize,
                    previous_facts: Sequence[Sequence[int]] = (),
                    related_facts: Sequence[Sequence[int]] = ()) -> list[int]:
        if source is None or self.options.window == 0:
            return []
        first = max(0, source - self.options.window + 1)
        return _turn_ids(turns[first : source + 1], tokenize)


class TokensWindow(WindowPolicy):
    """As many tokens before the fact as fit in ``max_tokens``, cut on the left.

    The conversation up to and including the source turn is tokenized turn by
    turn (each turn rendered as in :meth:`Turn.render`); the last
    ``max_tokens`` ids are kept, so the first kept turn may be cut mid-way.
    """

    name = "tokens"

    @dataclass(frozen=True)
    class Options:
        max_tokens: int

        def __post_init__(self):
            if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
                raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")

    def __init__(self, options: Options, **runtime):
        if options is None:
            raise ValueError("the 'tokens' window needs options: max_tokens")
        self.options = options

    def context_ids(self, turns: Sequence[Turn], source: int | None, tokenize: Tokenize,
                    previous_facts: Sequence[Sequence[int]] = (),
                    related_facts: Sequence[Sequence[int]] = ()) -> list[int]:
        budget = self.options.max_tokens
        if source is None or budget == 0:
            return []
        chunks: list[list[int]] = []
        have = 0
        for turn in reversed(turns[: source + 1]):  # tokenize only what can fit
            chunks.append(tokenize(turn.render()))
            have += len(chunks[-1])
            if have >= budget:
                break
        ids = [t for chunk in reversed(chunks) for t in chunk]
        return ids[-budget:]


class NoWindow(WindowPolicy):
    """No context: every fact is encoded on its own, from position 0 (w = 0)."""

    name = "none"

    def __init__(self, options: None = None, **runtime):
        self.options = options

    def context_ids(self, turns: Sequence[Turn], source: int | None, tokenize: Tokenize,
                    previous_facts: Sequence[Sequence[int]] = (),
                    related_facts: Sequence[Sequence[int]] = ()) -> list[int]:
        return []


class FactsWindow(_CountedWindow):
    """The ``window`` facts stored before this one, as they read in the segment.

    With ``window`` at least the number of facts, injecting the facts in the
    order they were given reproduces prompt injection's K/V exactly (each fact
    saw exactly what precedes it in the prompt); composed in another order or
    from a subset, every fact still reads as one item of a list of facts.
    """

    name = "facts"
    Options = _counted(10, "facts")

    def context_ids(self, turns: Sequence[Turn], source: int | None, tokenize: Tokenize,
                    previous_facts: Sequence[Sequence[int]] = (),
                    related_facts: Sequence[Sequence[int]] = ()) -> list[int]:
        return _last_facts(previous_facts, self.options.window)


class NeighboursWindow(_CountedWindow):
    """The ``window`` facts most related to this one, the most related last.

    At serving time a fact is read behind the other facts retrieved with it:
    facts close to the question, and so to each other. Encoding each fact
    behind its nearest neighbours under the retrieval embedder (rather than
    behind the facts stored just before it) computes its K/V behind the facts
    it will most likely be read with. The caller ranks the neighbours
    (:func:`inferscale.encode.related.nearest`) among every fact of the user
    known at encoding time.
    """

    name = "neighbours"
    Options = _counted(5, "facts")

    @property
    def related(self) -> int:
        return self.options.window

    def context_ids(self, turns: Sequence[Turn], source: int | None, tokenize: Tokenize,
                    previous_facts: Sequence[Sequence[int]] = (),
                    related_facts: Sequence[Sequence[int]] = ()) -> list[int]:
        return _last_facts(related_facts, self.options.window)


BUILTIN_POLICIES = (FactsWindow, NeighboursWindow, TurnsWindow, TokensWindow, NoWindow)
