"""Prompt layout around the memory segment, from the model's own chat template.

A prompt is ``[prefix | facts | query part]``: the prefix opens the system
message and holds the instruction, the facts follow one per line, and the
query part starts with the closing text (which ends the list of facts), closes
the system message, adds the user's question and opens the assistant's turn.
KV injection and prompt injection use the very same token ids; only how the
segment gets into the KV cache differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferscale.facts import render_fact

_FACTS = "\x00FACTS\x00"
_QUERY = "\x00QUERY\x00"


@dataclass(frozen=True)
class PromptFormat:
    prefix_text: str
    middle_text: str  # between the facts and the question
    suffix_text: str  # after the question

    @classmethod
    def from_tokenizer(cls, tokenizer, instruction: str, closing: str = "") -> PromptFormat:
        """Split the chat template around the facts and the question."""
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": instruction + _FACTS + closing},
                        {"role": "user", "content": _QUERY}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = f"{instruction}{_FACTS}{closing}\nQuestion: {_QUERY}\nAnswer:"
        prefix, rest = text.split(_FACTS)
        middle, suffix = rest.split(_QUERY)
        return cls(prefix, middle, suffix)

    def prefix_ids(self, tokenizer) -> list[int]:
        return _encode(tokenizer, self.prefix_text)

    def query_ids(self, tokenizer, query: str) -> list[int]:
        return _encode(tokenizer, self.middle_text + query + self.suffix_text)

    def prompt_ids(self, tokenizer, fact_token_ids: Sequence[Sequence[int]], query: str) -> list[int]:
        ids = self.prefix_ids(tokenizer)
        for fact in fact_token_ids:
            ids.extend(fact)
        return ids + self.query_ids(tokenizer, query)


def fact_token_ids(tokenizer, text: str, style: str = "bullet") -> list[int]:
    """A fact's token ids inside the segment."""
    return _encode(tokenizer, render_fact(text, style))


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))
