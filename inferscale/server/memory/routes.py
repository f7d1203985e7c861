"""The memory endpoints, in the spirit of Mem0's API, over :class:`MemoryAPI`.

``POST /v1/memories``               add facts, or a conversation (Mem0 extraction on the served model)
``GET /v1/memories?user_id=``       list a user's facts
``GET /v1/memories/{id}?user_id=``  one fact
``POST /v1/memories/search``        a user's facts most relevant to a query
``PUT /v1/memories/{id}``           change a fact's text (a new fact, encoded again, under a new id)
``DELETE /v1/memories/{id}?user_id=``  delete a fact
``DELETE /v1/memories?user_id=``    forget a user: facts, K/V, embeddings, Mem0's store and history
``GET /v1/users``                   every user with memory

Writes take turns on the encoder in arrival order, a large add a chunk per turn
(:mod:`inferscale.server.memory.write_queue`); reads run beside them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import anyio.from_thread
from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from inferscale.api import ExtractionError, Turn
from inferscale.errors import ConfigError, MissingFactError, UnknownUserError
from inferscale.facts import MAX_USER_ID_CHARS, check_request_user_id
from inferscale.server.engine import forward
from inferscale.server.bodies import model_body
from inferscale.server.errors import APIError
from inferscale.server.memory.schemas import AddMemories, MessageIn, SearchMemories, UpdateMemory, fact_json
from inferscale.server.state import ServerState
from inferscale.server.memory.write_queue import chunks

logger = logging.getLogger(__name__)
router = APIRouter()
USER_QUERY = Query(..., max_length=MAX_USER_ID_CHARS)


def _state(request: Request) -> ServerState:
    return request.app.state.inferscale


def _user(user_id: str) -> str:
    try:
        return check_request_user_id(user_id)
    except ValueError as exc:
        raise APIError(400, str(exc), "user_id") from None


@router.post("/v1/memories", status_code=201)
def add_memories(request: Request, body: AddMemories = Depends(model_body(AddMemories))) -> dict[str, Any]:
    state = _state(request)
    if body.facts is None and body.messages is None:
        raise APIError(400, "give 'facts' to store, or 'messages' to extract facts from", "facts")
    turns = _turns(body.messages or [])
    with state.user_locks.hold(body.user_id), state.metrics.timed(state.metrics.memory.labels("add")):
        start = time.perf_counter()
        if body.facts is None:
            with state.write_lock:
                given = _extract(state, body.user_id, turns)
        else:
            given = [_fact(f) for f in body.facts]
        added = _add_in_turns(state, body.user_id, given, turns)
    logger.info("%s: %d fact(s) stored in %.2f s", body.user_id, len(added), time.perf_counter() - start)
    return {"user_id": body.user_id, "results": [fact_json(f) for f in added]}


def _add_in_turns(state: ServerState, user_id: str, given: list[tuple[str, str | None]], turns) -> list:
    """The facts stored a chunk per turn of the encoder, so other users' writes come in between."""
    added = []
    for chunk in chunks(_per_turn(given, state.memory.config.max_facts_per_turn)):
        with state.write_lock:
            added += state.memory.add_facts(user_id, chunk, turns)
    return added


@router.get("/v1/memories")
def list_memories(request: Request, user_id: str = USER_QUERY) -> dict[str, Any]:
    state, user_id = _state(request), _user(user_id)
    with state.metrics.timed(state.metrics.memory.labels("list")):
        facts = state.memory.list_facts(user_id)
    return {"user_id": user_id, "results": [fact_json(f) for f in facts]}


@router.api_route("/v1/memories/search", methods=["GET", "PUT", "PATCH", "DELETE"], include_in_schema=False)
def search_by_another_method(request: Request) -> None:
    """Searching is a POST (its query travels in the body): any other method is a 405, not a
    request for the fact called ``search``."""
    raise APIError(405, f"{request.method} /v1/memories/search: searching takes POST with "
                        f'{{"user_id", "query", "k"}} in the body', headers={"Allow": "POST"})


@router.get("/v1/memories/{fact_id}")
def get_memory(fact_id: str, request: Request, user_id: str = USER_QUERY) -> dict[str, Any]:
    state, user_id = _state(request), _user(user_id)
    facts = {f.fact_id: f for f in state.memory.list_facts(user_id)}
    if fact_id not in facts:
        raise MissingFactError(user_id, [fact_id])
    return {"user_id": user_id, "result": fact_json(facts[fact_id])}


@router.post("/v1/memories/search")
def search_memories(request: Request, body: SearchMemories = Depends(model_body(SearchMemories))) -> dict[str, Any]:
    state = _state(request)
    with state.metrics.timed(state.metrics.memory.labels("search")):
        found = state.memory.search(body.user_id, body.query, body.k)
    return {"user_id": body.user_id, "results": [fact_json(f.fact, f.score) for f in found]}


@router.put("/v1/memories/{fact_id}")
def update_memory(fact_id: str, request: Request,
                  body: UpdateMemory = Depends(model_body(UpdateMemory))) -> dict[str, Any]:
    state = _state(request)
    with state.user_locks.hold(body.user_id), state.write_lock, \
            state.metrics.timed(state.metrics.memory.labels("update")):
        new = state.memory.update_fact(body.user_id, fact_id, body.text)
    reset = _reset_prefix_cache(state)
    logger.info("%s: fact %s replaced by %s; prefix cache reset: %s", body.user_id, fact_id, new.fact_id, reset)
    return {"user_id": body.user_id, "result": fact_json(new), "replaced": fact_id, **_reset_shown(reset)}


@router.delete("/v1/memories/{fact_id}")
def delete_memory(fact_id: str, request: Request, user_id: str = USER_QUERY) -> dict[str, Any]:
    state, user_id = _state(request), _user(user_id)
    with state.user_locks.hold(user_id), state.write_lock, state.metrics.timed(state.metrics.memory.labels("delete")):
        state.memory.delete_fact(user_id, fact_id)
    reset = _reset_prefix_cache(state)
    logger.info("%s: fact %s deleted; prefix cache reset: %s", user_id, fact_id, reset)
    return {"user_id": user_id, "deleted": fact_id, **_reset_shown(reset)}


@router.delete("/v1/memories")
async def forget_user(request: Request, user_id: str = USER_QUERY) -> JSONResponse:
    state, user_id = _state(request), _user(user_id)
    gone = await run_in_threadpool(_forget, state, user_id)
    if not gone.found:
        raise UnknownUserError(user_id)
    reset = await _reset_prefix_cache_async(state)
    logger.info("%s forgotten: %d fact(s), %d Mem0 memorie(s); prefix cache reset: %s", user_id, gone.facts,
                gone.mem0_memories, reset)
    return JSONResponse({"user_id": user_id, "facts_deleted": gone.facts, "mem0_memories_deleted": gone.mem0_memories,
                         "prefix_cache_reset": reset})


async def _reset_prefix_cache_async(state: ServerState) -> bool | None:
    """With ``--forget-resets-prefix-cache``, empty the engine's prefix cache after an erasure
    (None without the flag: the engine's lock already keeps every old salt out)."""
    return await forward.reset_prefix_cache(state.client) if state.forget_resets_prefix_cache else None


def _reset_prefix_cache(state: ServerState) -> bool | None:
    """:func:`_reset_prefix_cache_async` from a route that runs in a worker thread."""
    if not state.forget_resets_prefix_cache:
        return None
    return anyio.from_thread.run(forward.reset_prefix_cache, state.client)


def _reset_shown(reset: bool | None) -> dict[str, bool]:
    """A fact's answer says whether the prefix cache was reset only when the server resets it."""
    return {} if reset is None else {"prefix_cache_reset": reset}


def _forget(state: ServerState, user_id: str):
    with state.user_locks.hold(user_id), state.write_lock, state.metrics.timed(state.metrics.memory.labels("forget")):
        return state.memory.delete_user(user_id)


@router.get("/v1/users")
def list_users(request: Request) -> dict[str, Any]:
    return {"users": _state(request).memory.users()}


# ---------------------------------------------------------------- parts


def _per_turn(given: list[tuple[str, str | None]], most: int) -> list[tuple[str, str | None]]:
    """At most ``most`` facts of one source turn, the first ones (as one call of ``add_facts`` keeps)."""
    seen: dict[str, int] = {}
    kept = []
    for text, turn in given:
        seen[turn] = seen.get(turn, 0) + 1
        if turn is None or seen[turn] <= most:
            kept.append((text, turn))
    return kept


def _fact(item) -> tuple[str, str | None]:
    return (item, None) if isinstance(item, str) else (item.text, item.source_turn)


def _turns(messages: list[MessageIn]) -> list[Turn]:
    """The conversation as turns; unnamed turns get ids from the conversation's content,
    so adding the same conversation again names its facts alike."""
    digest = hashlib.sha256(json.dumps([m.model_dump() for m in messages]).encode()).hexdigest()[:10]
    return [Turn(m.turn_id or f"c{digest}:{i + 1}", m.role, m.content) for i, m in enumerate(messages)]


def _extract(state: ServerState, user_id: str, turns: list[Turn]) -> list[tuple[str, str]]:
    """Mem0's extraction of the conversation, by the served model."""
    try:
        return state.memory.extract_facts(user_id, turns, state.engine_v1, progress=False, user_speaker="user",
                                          name_speakers=False, llm_model=state.served_model,
                                          api_key=state.engine_key)
    except (ExtractionError, ConfigError) as exc:
        raise APIError(503, f"fact extraction failed: {exc}") from None


# after every real route: Starlette matches in order, and POST /v1/memories/search is one
@router.api_route("/v1/memories", methods=["PUT", "PATCH"], include_in_schema=False)
def memories_by_another_method(request: Request) -> None:
    """The collection answers GET (list), POST (add) and DELETE (forget a user): anything else is a 405."""
    raise APIError(405, f"{request.method} /v1/memories: use GET (list), POST (add) or DELETE (forget a user)",
                   headers={"Allow": "GET, POST, DELETE"})


@router.api_route("/v1/memories/{fact_id}", methods=["POST", "PATCH"], include_in_schema=False)
def memory_by_another_method(fact_id: str, request: Request) -> None:
    """One fact answers GET, PUT (change its text) and DELETE: anything else is a 405."""
    raise APIError(405, f"{request.method} /v1/memories/{{id}}: use GET, PUT (change the text) or DELETE",
                   headers={"Allow": "GET, PUT, DELETE"})
