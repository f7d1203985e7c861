"""The Python API: one facade over memory building and serving.

    >>> mem = InferScale.from_config({"model": "qwen2.5-coder-0.5b-instruct", "data_dir": "/tmp/m"})
    >>> mem.add_conversation("alice", turns, facts=[("Alice owns a cat named Miso.", "D1:3")])
    >>> answer = mem.generate("alice", "What is my cat called?", k=10)
    >>> answer.text, answer.timings

``generate`` modes: ``"kv"`` injects the facts' stored K/V (vLLM prefills only
the question), ``"prompt"`` puts the same facts in the prompt as text (the
Mem0-style baseline, same token ids), ``"none"`` answers without memory.
"""

from __future__ import annotations

import os
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from inferscale.compose.prompt import PromptFormat, fact_token_ids
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
from inferscale.config import Config, build
from inferscale.connector.params import make_params, segment_salt
from inferscale.encode.window import Turn
from inferscale.errors import UnknownUserError
from inferscale.facts import Fact, make_fact_id
from inferscale.retrieval.base import Hit
from inferscale.storage.disk import DiskStore

Mode = Literal["kv", "prompt", "none"]


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


class InferScale:
    def __init__(self, config: Config, in_process: bool = False, **engine_kwargs: Any):
        """``in_process`` runs vLLM's engine core in this process (faster start);
        ``engine_kwargs`` go to ``vllm.LLM``."""
        self.config = config
        self.in_process = in_process
        self.engine_kwargs = engine_kwargs
        self._llm = None

    @classmethod
    def from_config(cls, config: Config | Mapping | str | os.PathLike | None = None, in_process: bool = False,
                    **engine_kwargs: Any) -> InferScale:
        """From a :class:`Config`, a dict, a TOML path, or (None) the environment."""
        if config is None:
            config = Config.from_env()
        elif isinstance(config, Mapping):
            config = Config.from_dict(config)
        elif not isinstance(config, Config):
            config = Config.from_toml(config)
        return cls(config, in_process, **engine_kwargs)

    # ------------------------------------------------------------ components

    @cached_property
    def model_dir(self) -> Path:
        from inferscale.models import resolve_model, model_dir

        kind, path, _ = resolve_model(self.config.model)
        if kind == "name":
            return model_dir(str(path), self.config.model.dtype)
        if kind == "gguf":
            raise ValueError(f"vLLM serves Hugging Face directories: convert {path} first (inferscale convert)")
        return path

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)

    @cached_property
    def prompt_format(self) -> PromptFormat:
        return PromptFormat.from_tokenizer(self.tokenizer, self.config.instruction, self.config.closing)

    @cached_property
    def prefix_ids(self) -> list[int]:
        """The instruction prefix's token ids (the segment's first tokens)."""
        return self.prompt_format.prefix_ids(self.tokenizer)

    @cached_property
    def disk(self) -> DiskStore:
        return DiskStore(DiskStore.Options(root=str(self.config.kv_path)))

    @cached_property
    def embedder(self):
        return build("embedder", self.config.embedder)

    @cached_property
    def composer(self):
        return build("composer", self.config.composer)

    @cached_property
    def retriever(self):
        """The index, rebuilt from the stored embeddings of every user."""
        retriever = build("retriever", self.config.retriever)
        for user_id in self.disk.users():
            ids, vectors = self.disk.embeddings(user_id)
            if ids:
                retriever.add(user_id, ids, vectors)
        return retriever

    @cached_property
    def _facts(self) -> dict[str, dict[str, Fact]]:
        return defaultdict(dict)

    @property
    def llm(self):
        if self._llm is None:
            from inferscale.connector.engine import make_llm

            self._llm = make_llm(str(self.model_dir), self.config, self.in_process, **self.engine_kwargs)
        return self._llm

    # ------------------------------------------------------------ offline

    def add_conversation(self, user_id: str, turns: Sequence[Turn],
                         facts: Sequence[str | tuple[str, str | None]] | None = None, *,
                         llm_base_url: str | None = None, progress: bool = True) -> list[Fact]:
        """Extract → encode → index: the offline step for one user's conversation.

        ``facts`` are already-extracted statements, each optionally with the
        turn_id it came from. Without them, Mem0's extraction pipeline runs on
        ``turns`` against the OpenAI-compatible LLM at ``llm_base_url``. At most
        ``config.max_facts_per_turn`` facts are kept per turn.
        """
        if facts is None:
            if llm_base_url is None:
                raise ValueError("add_conversation needs either facts or llm_base_url (to extract them with Mem0)")
            facts = self.extract_facts(user_id, turns, llm_base_url, progress=progress)
        records = self._make_facts(user_id, facts)
        from inferscale.encode.encoder import FactEncoder

        window = build("encoder", self.config.encoder)
        with FactEncoder.from_spec(str(self.model_dir), window, dtype=self.config.model.encode_dtype,
                                   fact_style=self.config.fact_style) as encoder:
            prefix = self._ensure_prefix(encoder)
            kvs = encoder.encode(records, turns, progress=progress, prefix_ids=prefix)
        vectors = self.embedder.embed([f.text for f in records])
        self.disk.put(user_id, kvs, {f.fact_id: f for f in records},
                      {f.fact_id: v for f, v in zip(records, vectors)})
        self.retriever.add(user_id, [f.fact_id for f in records], vectors)
        self._facts.pop(user_id, None)
        return records

    def extract_facts(self, user_id: str, turns: Sequence[Turn], llm_base_url: str, progress: bool = True,
                      **options: Any) -> list[tuple[str, str]]:
        """Mem0's extraction, turn by turn, as ``(fact, source turn_id)``."""
        from inferscale.extract import Mem0Extractor

        opts = Mem0Extractor.Options(llm_base_url=llm_base_url, store_dir=str(self.config.mem0_path),
                                     max_facts_per_turn=self.config.max_facts_per_turn, **options)
        with Mem0Extractor(opts) as extractor:
            return extractor.extract(user_id, turns, progress=progress)

    def _make_facts(self, user_id: str, facts) -> list[Fact]:
        per_turn: dict[str | None, int] = defaultdict(int)
        records: dict[str, Fact] = {}
        for item in facts:
            text, source = (item, None) if isinstance(item, str) else item
            per_turn[source] += 1
            if source is not None and per_turn[source] > self.config.max_facts_per_turn:
                continue
            fid = make_fact_id(user_id, text, source)
            records[fid] = Fact(fid, user_id, text, source, tuple(fact_token_ids(self.tokenizer, text, self.config.fact_style)))
        return list(records.values())

    def _ensure_prefix(self, encoder) -> list[int]:
        """Encode the instruction prefix once (position 0) and store it like a fact."""
        ids = self.prefix_ids
        if PREFIX_FACT in self.disk.list(SYSTEM_USER):
            (stored,) = self.disk.token_ids(SYSTEM_USER, [PREFIX_FACT])
            if list(stored) == ids:
                return ids
        self.disk.put(SYSTEM_USER, {PREFIX_FACT: encoder.encode_ids(ids)})
        return ids

    # ------------------------------------------------------------ serving

    def retrieve(self, user_id: str, query: str, k: int | None = None) -> list[Hit]:
        if self.retriever.count(user_id) == 0:
            raise UnknownUserError(user_id)
        vector = self.embedder.embed([query])
        return self.retriever.search(user_id, vector, k or self.config.top_k)[0]

    def prompt(self, user_id: str, query: str, fact_order: Sequence[str], mode: Mode = "kv",
               fresh_cache: bool = False, recompute_tokens: int | None = None,
               key_scale: float | None = None) -> tuple[dict, dict | None, int]:
        """``(prompt dict, kv_transfer_params or None, memory tokens)`` for vLLM.

        ``recompute_tokens`` and ``key_scale`` override the connector's
        configured blend for this request (None: the configured one).
        """
        question = self.prompt_format.query_ids(self.tokenizer, query)
        if mode == "none":
            return {"prompt_token_ids": self.prefix_ids + question}, None, 0
        facts = self._user_facts(user_id)
        segment = list(self.prefix_ids)
        for fact_id in fact_order:
            segment.extend(facts[fact_id].token_ids)
        ids, memory = segment + question, len(segment)
        nonce = f":{uuid.uuid4().hex}" if fresh_cache else ""
        if mode == "prompt":
            return {"prompt_token_ids": ids, "cache_salt": f"text{nonce}"}, None, memory
        salt = segment_salt(user_id, ids[:memory], recompute_tokens, key_scale) + nonce
        params = make_params(user_id, fact_order, recompute_tokens, key_scale)
        return {"prompt_token_ids": ids, "cache_salt": salt}, params, memory

    def _user_facts(self, user_id: str) -> dict[str, Fact]:
        if user_id not in self._facts:
            self._facts[user_id] = self.disk.facts(user_id)
        return self._facts[user_id]

    def generate(self, user_id: str, query: str, k: int | None = None, mode: Mode = "kv",
                 max_tokens: int = 64, fresh_cache: bool = False, recompute_tokens: int | None = None,
                 key_scale: float | None = None) -> Answer:
        """Answer ``query`` for ``user_id`` with the top-k facts (greedy decoding).

        In ``"kv"`` mode the facts at the segment's tail that fit in
        ``recompute_tokens`` are prefilled, the rest injected (default: the
        config's ``recompute_tokens``; see :mod:`inferscale.compose.blend`).
        """
        from inferscale.connector.compat import first_token_latency, greedy_sampling

        start = time.perf_counter()
        hits = self.retrieve(user_id, query, k) if mode != "none" else []
        retrieved = time.perf_counter()
        order = self.composer.order(hits)
        prompt, params, memory = self.prompt(user_id, query, order, mode, fresh_cache, recompute_tokens, key_scale)
        sampling = greedy_sampling(max_tokens, params)
        composed = time.perf_counter()
        (out,) = self.llm.generate([prompt], sampling, use_tqdm=False)
        done = time.perf_counter()
        report = ((out.kv_transfer_params or {}).get("inferscale") or {}) if params else {}
        ttft = first_token_latency(out)
        timings = {
            "retrieval": (retrieved - start) * 1e3,
            "compose": (composed - retrieved) * 1e3,
            "engine_ttft": ttft * 1e3 if ttft else float("nan"),
            "total": (done - start) * 1e3,
        }
        timings["query_to_first_token"] = timings["retrieval"] + timings["compose"] + timings["engine_ttft"]
        return Answer(out.outputs[0].text, mode, list(order), len(prompt["prompt_token_ids"]), memory,
                      report.get("injected_tokens", 0), report.get("fallback"),
                      report.get("recomputed_tokens", 0), timings)

    def close(self) -> None:
        """Shut the engine down (frees its memory and worker processes)."""
        if self._llm is not None:
            from inferscale.connector.compat import shutdown

            shutdown(self._llm)
            self._llm = None
