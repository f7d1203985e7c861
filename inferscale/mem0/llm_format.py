"""What Mem0 is sent and answers: one conversation turn as a message, the answer's schema
capped at ``max_facts_per_turn`` memories, the instruction that says so, and the LLM wrapper
that asks for that schema in place of Mem0's free ``json_object``."""

from __future__ import annotations

from typing import Any

from inferscale.encode.window import Turn

#: output budget per allowed fact: a ≤ 600-character text plus its JSON fields
TOKENS_PER_FACT = 192
MAX_FACT_CHARS = 600


class CappedLLM:
    """Mem0's LLM with ``json_object`` answers narrowed to ≤ ``max_facts`` memories.

    Mem0 asks for ``response_format={"type": "json_object"}``; this sends a JSON
    schema of the shape Mem0 parses instead, so a server with structured output
    (vLLM, OpenAI) cannot return more items, unterminated JSON, or another
    shape. Every other call and attribute goes to the wrapped LLM unchanged.
    """

    def __init__(self, llm: Any, max_facts: int):
        self._llm = llm
        self._format = memory_schema(max_facts)

    def generate_response(self, messages: list[dict], response_format: Any = None, **kwargs: Any) -> Any:
        if response_format == {"type": "json_object"}:
            response_format = self._format
        return self._llm.generate_response(messages, response_format=response_format, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)


def memory_schema(max_facts: int) -> dict:
    """An OpenAI ``response_format`` for Mem0's answer shape with at most ``max_facts`` items."""
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "text": {"type": "string", "minLength": 1, "maxLength": MAX_FACT_CHARS},
            "attributed_to": {"type": "string", "enum": ["user", "assistant"]},
        },
        "required": ["id", "text", "attributed_to"],
        "additionalProperties": False,
    }
    schema = {
        "type": "object",
        "properties": {"memory": {"type": "array", "items": item, "maxItems": max_facts}},
        "required": ["memory"],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "mem0_memories", "schema": schema}}


def cap_instruction(max_facts: int) -> str:
    """Mem0 custom instructions (its highest-priority input) stating the cap."""
    return (f"Return at most {max_facts} memories: the most important new facts stated in New Messages. "
            "Do not repeat a memory.")


def turn_message(turn: Turn, user_speaker: str, name_speakers: bool = True) -> dict:
    """One Mem0 message for a turn: role by speaker, content optionally prefixed with the name."""
    role = "user" if turn.speaker == user_speaker else "assistant"
    content = f"{turn.speaker}: {turn.text}" if name_speakers else turn.text
    return {"role": role, "content": content}
