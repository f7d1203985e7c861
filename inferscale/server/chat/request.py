"""A chat request with memory: whose, how much, which conversation; and what goes to vLLM.

The OpenAI ``user`` field (or ``inferscale.user_id``) names whose memory to
use; ``inferscale.k`` and ``inferscale.mode`` (``kv``, ``text``, ``none``)
tune it. The server lays out ``[memory | conversation]`` as token ids and
sends them to vLLM's ``/v1/completions`` (the one endpoint that takes token
ids in both supported releases), with the cache salt and, in ``kv`` mode, the
``kv_transfer_params`` that ask the connector for the facts. Sampling fields
pass through to vLLM, which validates them; chat fields that cannot apply to
a prompt laid out by the server (tools, logprobs, chat templates) are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from inferscale.facts import check_request_user_id, shown
from inferscale.server.errors import APIError
from inferscale.server.memory.schemas import k_of

#: ``inferscale.mode`` → the generation mode (``text``: the facts as text in the prompt; ``prompt``,
#: the Python API's name for it, is taken as an alias). Answers name the mode as it was asked.
MODES = {"kv": "kv", "text": "prompt", "prompt": "prompt", "none": "none"}
OPTIONS = ("user_id", "k", "mode")
#: refused when set: they need a chat template or tool parser that the server's layout replaces
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "logprobs",
               "top_logprobs", "audio", "modalities", "prediction", "web_search_options", "chat_template",
               "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "documents", "echo",
               "mm_processor_kwargs", "add_special_tokens", "reasoning_effort")
#: set by the server only
RESERVED = ("prompt", "prompt_embeds", "kv_transfer_params", "cache_salt")
#: chat fields that mean nothing to the completions endpoint
DROPPED = ("messages", "user", "inferscale", "max_completion_tokens", "max_tokens", "store", "metadata",
           "service_tier", "model")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: what only the server may ask the engine for, at the top of a body or in ``vllm_xargs``
SERVER_ONLY = ("kv_transfer_params", "cache_salt")
#: the text of a chat's messages, all together (a conversation must fit the served context anyway)
MAX_CHAT_CHARS = 1 << 20


@dataclass(frozen=True)
class ChatCall:
    """A parsed chat request. ``user_id`` None: no memory (vLLM's own chat endpoint answers)."""

    user_id: str | None
    mode: str  # as asked (a key of MODES)
    k: int | None
    messages: list[dict[str, str]]
    model: str | None
    stream: bool
    fields: dict[str, Any] = field(default_factory=dict)  # sampling fields for vLLM

    @property
    def generation_mode(self) -> str:
        """The mode :class:`GenerationAPI` knows it by (``text`` is ``prompt`` there)."""
        return MODES[self.mode]

    @property
    def query(self) -> str:
        """What memory is retrieved for: the user's last message."""
        return self.messages[-1]["content"]


def parse_chat(body: Mapping[str, Any], max_k: int) -> ChatCall:
    options = _options(body)
    user_id = _user(body, options)
    mode = _mode(options.get("mode"), user_id)
    k = _k(options.get("k"), max_k)
    if user_id is None:
        return ChatCall(None, mode, k, [], _model(body.get("model")), bool(body.get("stream")))
    _refuse_fields(body)
    messages = _messages(body.get("messages"))
    return ChatCall(user_id, mode, k, messages, _model(body.get("model")), bool(body.get("stream")), _sampling(body))


def completion_body(call: ChatCall, prompt: Mapping[str, Any], kv_transfer_params: dict | None,
                    model: str) -> dict[str, Any]:
    """The ``/v1/completions`` request: token ids, salt, memory params, the caller's sampling."""
    body = {**call.fields, "model": call.model or model, "prompt": list(prompt["prompt_token_ids"])}
    if prompt.get("cache_salt"):
        body["cache_salt"] = prompt["cache_salt"]
    if kv_transfer_params:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def refuse_reserved(body: Mapping[str, Any]) -> None:
    """A client may not set what only the server sets (memory params, the salt), neither at the
    top of the body nor in ``vllm_xargs`` (vLLM's extra sampling arguments, which it merges)."""
    for key in SERVER_ONLY:
        if key in body:
            raise APIError(400, f"'{key}' is set by the server; name the user ('user' or "
                                f"inferscale.user_id) to answer with memory", key)
    extra = body.get("vllm_xargs")
    if extra is None:
        return
    if not isinstance(extra, dict):
        raise APIError(400, f"'vllm_xargs' must be an object, got {type(extra).__name__}", "vllm_xargs")
    for key in SERVER_ONLY:
        if key in extra:
            raise APIError(400, f"'vllm_xargs.{key}' is set by the server, never by a client", "vllm_xargs")


# ---------------------------------------------------------------- parts


def _options(body: Mapping[str, Any]) -> dict[str, Any]:
    options = body.get("inferscale") or {}
    if not isinstance(options, dict):
        raise APIError(400, f"'inferscale' must be an object with {', '.join(OPTIONS)}", "inferscale")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise APIError(400, f"unknown inferscale option(s) {unknown}; known: {', '.join(OPTIONS)}", "inferscale")
    return options


def _user(body: Mapping[str, Any], options: Mapping[str, Any]) -> str | None:
    named, user = _checked_user(options.get("user_id")), _checked_user(body.get("user"))
    if named is not None and user is not None and named != user:
        raise APIError(400, f"'user' ({shown(user)}) and inferscale.user_id ({shown(named)}) differ", "user")
    return named if named is not None else user


def _checked_user(user_id: Any) -> str | None:
    """The id in NFC (:func:`check_request_user_id`), or None when not given."""
    if user_id is None:
        return None
    try:
        return check_request_user_id(user_id)
    except ValueError as exc:
        raise APIError(400, str(exc), "user") from None


def _mode(value: Any, user_id: str | None) -> str:
    if value is None:
        return "kv" if user_id is not None else "none"
    if not isinstance(value, str) or value not in MODES:
        raise APIError(400, f"inferscale.mode must be one of {', '.join(MODES)}, got {shown(value)}",
                       "inferscale.mode")
    if user_id is None and MODES[value] != "none":
        raise APIError(400, f"mode {value!r} needs a user: set 'user' or inferscale.user_id", "user")
    return value


def _k(value: Any, max_k: int) -> int | None:
    try:
        return k_of(value, "inferscale.k", max_k)
    except ValueError as exc:
        raise APIError(400, str(exc), "inferscale.k") from None


def _model(value: Any) -> str:
    """The model a chat names, required as OpenAI requires it."""
    if value is None:
        raise APIError(400, "'model' is required: the served model's name (GET /v1/models lists it)", "model")
    if not isinstance(value, str) or not value:
        raise APIError(400, f"'model' must be a model's name, got {shown(value)}", "model")
    return value


def _refuse_fields(body: Mapping[str, Any]) -> None:
    refuse_reserved(body)
    for key in RESERVED:
        if body.get(key) is not None:
            raise APIError(400, f"'{key}' is set by the server from the conversation", key)
    for key in UNSUPPORTED:
        value = body.get(key)
        if value not in (None, False, [], {}):
            raise APIError(400, f"'{key}' is not supported with memory (the server lays out the prompt); "
                                f"send the request without 'user' to use vLLM's own chat endpoint", key)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    messages = [_message(m, i) for i, m in enumerate(value)]
    if sum(len(m["content"]) for m in messages) > MAX_CHAT_CHARS:
        raise APIError(400, f"the messages hold more than {MAX_CHAT_CHARS:,} characters", "messages")
    if messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        raise APIError(400, "the last message must be the user's, with text", "messages")
    return messages


def _message(value: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(value, dict) or not isinstance(value.get("role"), str) or value["role"] not in ROLES:
        raise APIError(400, f"{where} needs a role in {', '.join(ROLES)}", where)
    if value.get("tool_calls") or value.get("function_call"):
        raise APIError(400, f"{where}: tool calls are not supported with memory", where)
    return {"role": ROLES[value["role"]], "content": _text(value.get("content"), where)}


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}: only text content is supported, got {shown(part)}", where)
            parts.append(part["text"])
        return "\n".join(parts)
    raise APIError(400, f"{where}: content must be text", where)


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    fields = {k: v for k, v in body.items() if k not in DROPPED}
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    fields["max_tokens"] = limit  # None: up to the context limit, as chat does (completions would stop at 16)
    return fields
