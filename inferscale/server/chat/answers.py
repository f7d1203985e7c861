"""vLLM's completion answers in the shape of OpenAI chat completions.

The server answers a chat with memory through vLLM's ``/v1/completions``
(token ids in); the client asked for a chat, so each answer is reshaped: a
``text_completion`` becomes a ``chat.completion`` (the text as the
assistant's message), each streamed chunk a ``chat.completion.chunk`` (the
text as a delta; the first delta of each choice names the role). Usage,
finish reasons and ids carry over; vLLM's per-request memory report
(``kv_transfer_params``) is returned as ``inferscale.report`` (vLLM sends it
with whole answers only, not with streams).
"""

from __future__ import annotations

from typing import Any


def chat_completion(completion: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """A whole ``chat.completion`` from a ``text_completion``; ``info`` goes under ``inferscale``."""
    report = ((completion.get("kv_transfer_params") or {}).get("inferscale"))
    return {
        "id": _chat_id(completion.get("id")),
        "object": "chat.completion",
        "created": completion.get("created"),
        "model": completion.get("model"),
        "choices": [_choice(c) for c in completion.get("choices", [])],
        "usage": completion.get("usage"),
        "system_fingerprint": completion.get("system_fingerprint"),
        "inferscale": {**info, "report": report} if report is not None else info,
    }


def chat_chunk(chunk: dict[str, Any], started: set[int], info: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk``; ``started`` holds the choices whose role was sent."""
    out = {
        "id": _chat_id(chunk.get("id")),
        "object": "chat.completion.chunk",
        "created": chunk.get("created"),
        "model": chunk.get("model"),
        "choices": [_delta(c, started) for c in chunk.get("choices", [])],
    }
    if chunk.get("usage") is not None:
        out["usage"] = chunk["usage"]
    if info is not None:
        out["inferscale"] = info
    return out


def _choice(choice: dict[str, Any]) -> dict[str, Any]:
    return {"index": choice.get("index", 0), "message": {"role": "assistant", "content": choice.get("text", "")},
            "logprobs": None, "finish_reason": choice.get("finish_reason"),
            "stop_reason": choice.get("stop_reason")}


def _delta(choice: dict[str, Any], started: set[int]) -> dict[str, Any]:
    index = choice.get("index", 0)
    delta: dict[str, Any] = {"content": choice.get("text", "")}
    if index not in started:
        started.add(index)
        delta = {"role": "assistant", **delta}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": choice.get("finish_reason")}


def _chat_id(completion_id: Any) -> str:
    return "chatcmpl-" + str(completion_id or "").removeprefix("cmpl-")
