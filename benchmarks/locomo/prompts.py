"""The prompt every method shares: the instruction, the closing lines, each fact's token ids in the
segment and the segment's order (the composer)."""

from __future__ import annotations

from inferscale.config import DEFAULT_CLOSING


INSTRUCTION = (
    "You answer questions about a conversation between two people, using the facts below that were "
    "remembered from it. Answer in a few words, with a date when asked when.\nFacts:\n"
)


#: text after the facts, before the question (always prefilled)
CLOSINGS = {"none": "", "answer": DEFAULT_CLOSING}
#: a closing that carries the question: the closing line, then the question itself, so the question is
#: read twice, at the end of the system message (fresh, after the facts) and again as the user's turn
ASK = "ask"


class Prompts:
    """Token ids of prompts, per fact style and closing (the same ids in every mode)."""

    def __init__(self, tokenizer, convs):
        from inferscale.compose.prompt import PromptFormat, fact_token_ids

        self.tokenizer, self.convs = tokenizer, convs
        self.formats = {c: PromptFormat.from_tokenizer(tokenizer, INSTRUCTION, text) for c, text in CLOSINGS.items()}
        self.prefix = self.formats["none"].prefix_ids(tokenizer)
        self._facts: dict = {}
        self._wrappers: dict = {}
        self._fact_token_ids = fact_token_ids

    def fact(self, conv: str, index: int, style: str, wrappers: str = "") -> list[int]:
        """A fact's ids in the segment (with ``wrappers``: as stored, its wrapper positions filled)."""
        key = (conv, index, style)
        if key not in self._facts:
            self._facts[key] = self._fact_token_ids(self.tokenizer, self.convs[conv].all_facts()[index][0], style)
        if not wrappers:
            return self._facts[key]
        if wrappers not in self._wrappers:
            from inferscale.encode.wrappers import FactWrappers

            self._wrappers[wrappers] = FactWrappers.load(wrappers)
        return list(self._wrappers[wrappers].wrapped(self._facts[key]))

    def query(self, closing: str, question: str) -> list[int]:
        if closing == ASK:
            from inferscale.compose.prompt import PromptFormat

            text = f"{CLOSINGS['answer']}Question: {question}\n"
            return PromptFormat.from_tokenizer(self.tokenizer, INSTRUCTION, text).query_ids(self.tokenizer, question)
        return self.formats[closing].query_ids(self.tokenizer, question)


def segment_order(retrieved: list[int], composer: str) -> list[int]:
    """Retrieved fact indices (best first) in segment order: the "relevance" composer's (the most
    relevant last) or the "stored" composer's (the order the facts were stored in)."""
    if composer == "stored":
        return sorted(retrieved)
    if composer == "relevance":
        return retrieved[::-1]
    raise ValueError(f"unknown composer order {composer!r}")
