"""The Python API: the memory side and the generation side over one context.

    >>> mem = InferScale.from_config({"model": "qwen2.5-coder-0.5b-instruct", "data_dir": "/tmp/m"})
    >>> mem.add_conversation("alice", turns, facts=[("Alice owns a cat named Miso.", "D1:3")])
    >>> answer = mem.generate("alice", "What is my cat called?", k=10)
    >>> answer.text, answer.timings

``mem.memory`` (:class:`MemoryAPI`: add, list, search, update, delete) and
``mem.generation`` (:class:`GenerationAPI`: retrieve, prompt, compose, generate) share
one :class:`Context`; each also works alone (``MemoryAPI(Context(config))``),
as a server that runs them in separate processes needs. The files: ``memory.py``, ``generation.py``
(the two sides), ``context.py`` (what they share, built lazily: tokenizer, store of record, salts,
retriever), ``freshness.py`` (each user's retrieval index kept at the record's version),
``checks.py`` (what a call is checked for as it enters); Mem0 is reached from here only, through
:mod:`inferscale.mem0`'s exported names.

``generate`` modes: ``"kv"`` injects the facts' stored K/V (vLLM prefills only
the question and the tail facts within the recompute budget), ``"prompt"``
puts the same facts in the prompt as text (the Mem0-style baseline, same token
ids), ``"none"`` answers without memory.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from inferscale.api.context import Context, load_config
from inferscale.api.generation import Answer, Composed, GenerationAPI, Mode, PromptRequest
from inferscale.api.memory import ExtractionError, Forgotten, FoundFact, MemoryAPI, Turn, extraction_tokens
from inferscale.compose.request import MAX_FACTS  # the most facts one request may name (k's bound)
from inferscale.config import Config
from inferscale.session import SESSION_HEADER

__all__ = ["MAX_FACTS", "SESSION_HEADER", "Answer", "Composed", "Context", "ExtractionError", "Forgotten", "FoundFact", "GenerationAPI", "InferScale",
           "MemoryAPI", "Mode", "PromptRequest", "Turn", "extraction_tokens"]


class InferScale:
    def __init__(self, config: Config, in_process: bool = False, **engine_kwargs: Any):
        """``in_process`` runs vLLM's engine core in this process (faster start);
        ``engine_kwargs`` go to ``vllm.LLM``. A model that is neither a directory, a GGUF file
        nor a known name is a :class:`ConfigError` here, not when the engine starts."""
        from inferscale.encode.weights import resolve_model

        resolve_model(config.model)
        self.config = config
        self.context = Context(config)
        self.memory = MemoryAPI(self.context)
        self.generation = GenerationAPI(self.context, in_process, **engine_kwargs)

    @classmethod
    def from_config(cls, config: Config | Mapping | str | os.PathLike | None = None, in_process: bool = False,
                    **engine_kwargs: Any) -> InferScale:
        """From a :class:`Config`, a dict, a TOML path, or (None) the environment."""
        return cls(load_config(config), in_process, **engine_kwargs)

    @property
    def model_dir(self):
        return self.context.model_dir

    @property
    def prefix_ids(self) -> list[int]:
        return self.context.prefix_ids

    def add_conversation(self, user_id: str, turns: Sequence, facts: Sequence | None = None, **kwargs: Any):
        """See :meth:`MemoryAPI.add_conversation`."""
        return self.memory.add_conversation(user_id, turns, facts, **kwargs)

    def generate(self, user_id: str, query: str, k: int | None = None, mode: Mode = "kv", **kwargs: Any) -> Answer:
        """See :meth:`GenerationAPI.generate`."""
        return self.generation.generate(user_id, query, k, mode, **kwargs)

    def close(self) -> None:
        """Release the fact encoder and shut the engine down."""
        self.memory.close()
        self.generation.close()
