"""Prompt layout around the memory segment, from the model's own chat template.

A prompt is ``[prefix | facts | query part]``: the prefix opens the system
message and holds the instruction, the facts follow one per line, and the
query part starts with the closing text (which ends the list of facts), closes
the system message, adds the user's question and opens the assistant's turn.
KV injection and prompt injection use the very same token ids; only how the
segment gets into the KV cache differs.

A chat (:meth:`PromptFormat.chat_ids`) keeps the same segment: the client's
system text follows the closing text inside the memory's system message, and
the conversation follows it, ending with the assistant's turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from inferscale.facts import render_fact

_FACTS = "\x00FACTS\x00"
_QUERY = "\x00QUERY\x00"
#: without a chat template, how each role's turn reads (a user's question ends as "Question: ...")
_PLAIN_ROLES = {"user": "Question", "assistant": "Answer"}
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class PromptFormat:
    prefix_text: str
    middle_text: str  # between the facts and the question
    suffix_text: str  # after the question
    instruction: str = ""
    closing: str = ""
    templated: bool = True  # from the tokenizer's chat template

    @classmethod
    def from_tokenizer(cls, tokenizer, instruction: str, closing: str = "") -> PromptFormat:
        """Split the chat template around the facts and the question."""
        templated = bool(getattr(tokenizer, "chat_template", None))
        if templated:
            messages = [{"role": "system", "content": instruction + _FACTS + closing},
                        {"role": "user", "content": _QUERY}]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = f"{instruction}{_FACTS}{closing}\nQuestion: {_QUERY}\nAnswer:"
        prefix, rest = text.split(_FACTS)
        middle, suffix = rest.split(_QUERY)
        return cls(prefix, middle, suffix, instruction, closing, templated)

    def prefix_ids(self, tokenizer) -> list[int]:
        return _encode(tokenizer, self.prefix_text)

    def query_ids(self, tokenizer, query: str) -> list[int]:
        return _encode(tokenizer, self.middle_text + query + self.suffix_text)

    def chat_ids(self, tokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """What follows the facts for a conversation (``[{"role", "content"}, ...]``,
        roles ``system``, ``user``, ``assistant``); one user message gives
        exactly :meth:`query_ids`."""
        return _encode(tokenizer, self.chat_text(tokenizer, messages))

    def chat_text(self, tokenizer, messages: Sequence[Mapping[str, str]]) -> str:
        for message in messages:
            if message.get("role") not in CHAT_ROLES or not isinstance(message.get("content"), str):
                raise ValueError(f"a chat message needs a role in {CHAT_ROLES} and text content, got {message!r}")
        system = "\n".join(m["content"] for m in messages if m["role"] == "system")
        turns = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
        if not self.templated:
            lines = "".join(f"{_PLAIN_ROLES[m['role']]}: {m['content']}\n" for m in turns)
            return f"{self.closing}{system}\n{lines}Answer:"
        head = {"role": "system", "content": self.instruction + _FACTS + self.closing + system}
        text = tokenizer.apply_chat_template([head, *turns], tokenize=False, add_generation_prompt=True)
        prefix, rest = text.split(_FACTS)
        if prefix != self.prefix_text:
            raise ValueError("the chat template lays out the system message differently with this conversation")
        return rest

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
