"""``POST /v1/chat/completions``: a chat answered with the user's memory.

Retrieval, composition (memory, then the conversation), tokenization with the
model's chat template and the cache salt happen here, through
:meth:`GenerationAPI.compose` (the path ``generate`` takes too); vLLM gets
token ids on ``/v1/completions`` and prefills only what is not injected.
Without a user, the request goes to vLLM's own chat endpoint unchanged.

An engine whose ``kv_load_failure_policy`` is ``"fail"`` (``compat.load_failure_policy``)
ends a request whose memory the worker could not load with ``finish_reason="error"``
and no text; the front then answers the same chat once more with the facts as text
(prompt injection), so the user gets an answer from the same memory, never one from
wrong K/V, and ``inferscale.retried`` says why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from inferscale.api import MAX_FACTS, SESSION_HEADER, PromptRequest
from inferscale.errors import CorruptDataError, MissingFactError, StoreUnavailableError
from inferscale.server.cluster import failover
from inferscale.server.engine import forward
from inferscale.server.bodies import read_json
from inferscale.server.chat.request import ChatCall, completion_body, parse_chat, refuse_reserved
from inferscale.server.chat.answers import chat_chunk, chat_completion
from inferscale.server.state import ServerState

logger = logging.getLogger(__name__)
router = APIRouter()
#: ``inferscale.fallback`` of a chat answered without the user's memory, which could not be read
UNREADABLE = "unreadable_memory"
#: ``inferscale.fallback`` of a chat answered by plain prefill: the store of record did not answer
STORE_UNAVAILABLE = "store_unavailable"


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.inferscale
    body = await read_json(request)
    call = parse_chat(body, MAX_FACTS)
    state.metrics.chats.labels(call.generation_mode).inc()
    if call.user_id is None:
        return await _plain_chat(state, body)
    return await _answer(state, call)


async def _answer(state: ServerState, call: ChatCall, retried: str | None = None) -> Response:
    prompt, info = await run_in_threadpool(compose, state, call)
    if retried:
        info["retried"] = retried
    call = dataclasses.replace(call, model=state.engine_model(call.model))
    upstream = completion_body(call, prompt.prompt, prompt.kv_transfer_params, state.served_model)
    headers = {SESSION_HEADER: state.generation.context.session_id(call.user_id)}
    if call.stream:
        return await _stream(state, call, upstream, info, headers)
    status, answer = await failover.post_json(state, "/v1/completions", upstream, headers)
    if status != 200:
        return JSONResponse(answer, status_code=status)
    if _load_failed(call, answer):
        return await _as_text(state, call)
    return JSONResponse(chat_completion(answer, info))


def _load_failed(call: ChatCall, completion: Any) -> bool:
    """The engine ended an injected request with an error (its memory could not be loaded)."""
    if call.generation_mode != "kv" or not isinstance(completion, dict):
        return False
    choices = completion.get("choices") or [{}]
    return isinstance(choices[0], dict) and choices[0].get("finish_reason") == "error"


def _parsed(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return None


async def _as_text(state: ServerState, call: ChatCall) -> Response:
    logger.warning("inferscale: the engine could not load %s's memory; answering with the facts as text",
                   call.user_id)
    return await _answer(state, dataclasses.replace(call, mode="text"), retried="load_error")


def compose(state: ServerState, call: ChatCall) -> tuple[PromptRequest, dict[str, Any]]:
    """Retrieve the user's facts for the last message and lay out the request (in a worker thread)."""
    try:
        return _compose(state, call)
    except MissingFactError:  # a fact was deleted between retrieval and layout: once more
        return _compose(state, call)
    except CorruptDataError as exc:  # this user's memory is unreadable: answer without it, log why
        logger.error("inferscale: %s's memory is unreadable, answering without it: %s", call.user_id, exc)
        prompt, info = _compose(state, dataclasses.replace(call, mode="none"))
        return prompt, {**info, "fallback": UNREADABLE}
    except StoreUnavailableError as exc:  # nothing of the user's memory can be read: plain prefill
        logger.error("inferscale: answering %s without memory: %s", call.user_id, exc)
        prompt, info = _compose(state, dataclasses.replace(call, mode="none"))
        return prompt, {**info, "fallback": STORE_UNAVAILABLE}


def _compose(state: ServerState, call: ChatCall) -> tuple[PromptRequest, dict[str, Any]]:
    composed = state.generation.compose(call.user_id, call.query, call.k, call.generation_mode,
                                        conversation=call.messages)
    state.metrics.retrieval.observe(composed.retrieval_s)
    state.metrics.compose.observe(composed.compose_s)
    prompt = composed.request
    info = {"mode": call.mode, "fact_ids": prompt.fact_ids, "memory_tokens": prompt.memory_tokens,
            "prompt_tokens": prompt.num_tokens,
            "timings_ms": {"retrieval": round(composed.retrieval_s * 1e3, 3),
                           "compose": round(composed.compose_s * 1e3, 3)}}
    return prompt, info


async def _stream(state: ServerState, call: ChatCall, upstream: dict[str, Any], info: dict[str, Any],
                  headers: dict[str, str]) -> Response:
    response = await failover.open_stream(state, "/v1/completions", upstream, headers)
    if response.status_code != 200:
        return await forward.error_from(response)
    stream = forward.sse_events(response)
    first = await anext(stream, None)  # a failed load ends the stream at its first event
    if first not in (None, "[DONE]") and _load_failed(call, _parsed(first)):
        await response.aclose()
        return await _as_text(state, call)

    async def replayed():
        if first is not None:
            yield first
        async for data in stream:
            yield data

    async def events():
        started: set[int] = set()
        pending = info  # sent with the first chunk (the engine's report does not come with streams)
        try:
            async for data in replayed():
                chunk = data if data == "[DONE]" else json.loads(data)
                if isinstance(chunk, dict) and "error" not in chunk:
                    chunk, pending = chat_chunk(chunk, started, pending), None
                yield forward.sse(chunk)
        finally:
            await response.aclose()

    return StreamingResponse(events(), media_type="text/event-stream")


async def _plain_chat(state: ServerState, body: dict[str, Any]) -> Response:
    """No user: vLLM's own chat endpoint answers, exactly as ``vllm serve`` would."""
    refuse_reserved(body)
    body.pop("inferscale", None)
    body["model"] = state.engine_model(body["model"])
    return await forward.relay(state.client, state.client.build_request("POST", "/v1/chat/completions", json=body))
