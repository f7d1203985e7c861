"""The generation side: retrieve a user's facts, lay out the prompt, answer.

``compose`` is the one path from a question to a request (retrieve, order, lay
out): ``generate`` and the server's chat both take it.

``prompt`` builds what vLLM takes (token ids, cache salt, ``kv_transfer_params``)
and needs no engine, so a server can send it to its own ``vllm serve``. The
cache salt is keyed with the server secret and the user's epoch
(:mod:`inferscale.compose.salt`): only a holder of the secret can build a
request the connector injects memory into, and users never share cached blocks;
``generate`` runs it on an in-process ``vllm.LLM`` built on first use.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from inferscale.api.checks import mode as check_mode
from inferscale.api.checks import top_k, user_call
from inferscale.api.context import Context
from inferscale.compose.request import make_params
from inferscale.config import build
from inferscale.errors import UnknownUserError
from inferscale.facts import Hit

Mode = Literal["kv", "prompt", "none"]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptRequest:
    """One request for vLLM: ``prompt`` (token ids and cache salt) and, for KV
    injection, the ``kv_transfer_params`` that ask the connector for the facts."""

    prompt: dict
    kv_transfer_params: dict | None
    fact_ids: list[str]
    memory_tokens: int  # the segment: instruction prefix and facts

    @property
    def num_tokens(self) -> int:
        return len(self.prompt["prompt_token_ids"])


@dataclass(frozen=True)
class Composed:
    """A request laid out from the facts retrieved for it, and what each step took (seconds)."""

    request: PromptRequest
    retrieval_s: float
    compose_s: float


@dataclass
class Answer:
    text: str
    mode: str
    fact_ids: list[str]
    prompt_tokens: int
    memory_tokens: int
    injected_tokens: int
    fallback: str | None
    recomputed_tokens: int = 0  # memory tokens prefilled with the question (kv mode)
    timings: dict[str, float] = field(default_factory=dict)  # milliseconds


class GenerationAPI:
    def __init__(self, context: Context, in_process: bool = False, **engine_kwargs: Any):
        """``in_process`` runs vLLM's engine core in this process (faster start);
        ``engine_kwargs`` go to ``vllm.LLM``."""
        self.context = context
        self.config = context.config
        self.in_process = in_process
        self.engine_kwargs = engine_kwargs
        self._llm = None
        context.erasure_listeners.append(self._drop_cached_memory)

    @cached_property
    def composer(self):
        return build("composer", self.config.composer)

    @property
    def llm(self):
        """The engine, started on first use (minutes the first time on a CPU: vLLM compiles)."""
        if self._llm is None:
            from inferscale.connector.engine import make_llm

            logger.warning("inferscale: starting vLLM's engine for %s (the first start takes minutes on a CPU: vLLM "
                           "loads and compiles the model; later calls reuse it) ...", self.config.model.path)
            start = time.perf_counter()
            self._llm = make_llm(str(self.context.model_dir), self.config, self.in_process, **self.engine_kwargs)
            logger.warning("inferscale: the engine is ready (%.0f s)", time.perf_counter() - start)
        return self._llm

    @user_call
    def retrieve(self, user_id: str, query: str, k: int | None = None) -> list[Hit]:
        k = top_k(k)
        retriever = self.context.retriever_for(user_id)
        if retriever.count(user_id) == 0:
            raise UnknownUserError(user_id)
        return retriever.search(user_id, self.context.embedder.embed([query]), k or self.config.top_k)[0]

    @user_call
    def compose(self, user_id: str, query: str, k: int | None = None, mode: Mode = "kv",
                conversation: Sequence[Mapping[str, str]] | None = None, **prompt_options: Any) -> Composed:
        """Retrieve the user's top-k facts for ``query``, order them as the composer does, and
        lay out the request (:meth:`prompt`) that answers ``query``, or ``conversation`` (a chat
        whose last message ``query`` is) after the memory. ``prompt_options`` go to :meth:`prompt`.
        Mode ``"none"`` retrieves nothing."""
        k, mode = top_k(k), check_mode(mode)
        start = time.perf_counter()
        hits = self.retrieve(user_id, query, k) if mode != "none" else []
        retrieved = time.perf_counter()
        asked = query if conversation is None else conversation
        request = self.prompt(user_id, asked, self.composer.order(hits), mode, **prompt_options)
        return Composed(request, retrieved - start, time.perf_counter() - retrieved)

    @user_call
    def prompt(self, user_id: str, query: str | Sequence[Mapping[str, str]], fact_order: Sequence[str],
               mode: Mode = "kv", fresh_cache: bool = False, recompute_tokens: int | None = None,
               key_scale: float | None = None) -> PromptRequest:
        """The request that answers ``query`` from these facts, in this order.

        ``query`` is a question, or a conversation (``[{"role", "content"}, ...]``,
        placed after the memory: :meth:`PromptFormat.chat_ids`).
        ``recompute_tokens`` and ``key_scale`` override the connector's
        configured blend for this request (None: the configured one).
        ``fresh_cache`` adds a nonce to the salt: no prefix-cache reuse at all.
        """
        mode = check_mode(mode)
        ctx = self.context
        question = (ctx.prompt_format.query_ids(ctx.tokenizer, query) if isinstance(query, str)
                    else ctx.prompt_format.chat_ids(ctx.tokenizer, query))
        if mode == "none":
            return PromptRequest({"prompt_token_ids": ctx.prefix_ids + question}, None, [], 0)
        segment = list(ctx.prefix_ids)
        for ids in ctx.record.token_ids(user_id, list(fact_order)):
            segment.extend(ctx.text_ids(ids) if mode == "prompt" else ids)
        epoch = ctx.record.epoch(user_id)
        if epoch is None:  # deleted since its token ids were read
            raise UnknownUserError(user_id)
        ids, order = segment + question, list(fact_order)
        nonce = f":{uuid.uuid4().hex}" if fresh_cache else ""
        if mode == "prompt":
            salt = ctx.salts.text(user_id, epoch) + nonce
            return PromptRequest({"prompt_token_ids": ids, "cache_salt": salt}, None, order, len(segment))
        salt = ctx.salts.segment(user_id, epoch, segment, recompute_tokens, key_scale) + nonce
        params = make_params(user_id, order, recompute_tokens, key_scale, epoch, len(segment))
        return PromptRequest({"prompt_token_ids": ids, "cache_salt": salt}, params, order, len(segment))

    @user_call
    def generate(self, user_id: str, query: str, k: int | None = None, mode: Mode = "kv",
                 max_tokens: int = 64, fresh_cache: bool = False, recompute_tokens: int | None = None,
                 key_scale: float | None = None) -> Answer:
        """Answer ``query`` for ``user_id`` with the top-k facts (greedy decoding).

        In ``"kv"`` mode the facts at the segment's tail that fit in
        ``recompute_tokens`` are prefilled, the rest injected (default: the
        config's ``recompute_tokens``; see :mod:`inferscale.compose.blend`).
        """
        from inferscale.connector.compat import first_token_latency, greedy_sampling

        k, mode = top_k(k), check_mode(mode)
        start = time.perf_counter()
        composed = self.compose(user_id, query, k, mode, fresh_cache=fresh_cache, recompute_tokens=recompute_tokens,
                                key_scale=key_scale)
        request = composed.request
        sampling = greedy_sampling(max_tokens, request.kv_transfer_params)
        (out,) = self.llm.generate([request.prompt], sampling, use_tqdm=False)
        done = time.perf_counter()
        report = ((out.kv_transfer_params or {}).get("inferscale") or {}) if request.kv_transfer_params else {}
        ttft = first_token_latency(out)
        timings = {
            "retrieval": composed.retrieval_s * 1e3,
            "compose": composed.compose_s * 1e3,
            "engine_ttft": ttft * 1e3 if ttft else float("nan"),
            "total": (done - start) * 1e3,
        }
        timings["query_to_first_token"] = timings["retrieval"] + timings["compose"] + timings["engine_ttft"]
        return Answer(out.outputs[0].text, mode, request.fact_ids, request.num_tokens, request.memory_tokens,
                      report.get("injected_tokens", 0), report.get("fallback"),
                      report.get("recomputed_tokens", 0), timings)

    def _drop_cached_memory(self, user_id: str) -> None:
        """Something of a user's memory is gone: empty the in-process engine's prefix cache, which
        may hold blocks computed from it under a salt of theirs (running requests are computed
        again), so that no request, even one holding that salt, reads them back."""
        if self._llm is not None:
            self._llm.reset_prefix_cache(reset_running_requests=True)

    def close(self) -> None:
        """Shut the engine down (frees its memory and worker processes)."""
        if self._llm is not None:
            from inferscale.connector.compat import shutdown

            shutdown(self._llm)
            self._llm = None
