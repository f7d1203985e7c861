"""What both sides of the API share: the config and the pieces built from it, lazily.

A :class:`Context` builds nothing until asked: the tokenizer, the prompt layout,
the store of record (the one home of every fact: the disk store, or a shared one
such as Redis), the cache salts (keyed with the
server secret), the embedder and the retrieval index (rebuilt from the stored
embeddings). The memory side and the generation
side each take one, so a server can run either alone or both over one context.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from pathlib import Path

from inferscale.api.freshness import IndexedEpochs
from inferscale.compose.prompt import PromptFormat
from inferscale.compose.salt import CacheSalts
from inferscale.config import Config, build
from inferscale.errors import CorruptDataError
from inferscale.facts import fact_id_key
from inferscale.secret import engine_key, load_secret
from inferscale.session import session_key
from inferscale.storage.tiers import StoreOfRecord, store_of_record

logger = logging.getLogger(__name__)


def load_config(config: Config | Mapping | str | os.PathLike | None) -> Config:
    """A :class:`Config`, a dict, a TOML path, or (None) the environment."""
    if config is None:
        return Config.from_env()
    if isinstance(config, Mapping):
        return Config.from_dict(config)
    if isinstance(config, Config):
        return config
    return Config.from_toml(config)


class Context:
    def __init__(self, config: Config):
        self.config = config

    @cached_property
    def model_dir(self) -> Path:
        """The served model as a Hugging Face directory (offline models converted once)."""
        from inferscale.encode.weights import model_dir, resolve_model

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
    def wrappers(self):
        """The fact wrappers ``config.wrappers`` names (None: none), checked when first read."""
        if not self.config.wrappers:
            return None
        from inferscale.encode.wrappers import FactWrappers

        return FactWrappers.load(self.config.wrappers)

    def text_ids(self, stored: Sequence[int]) -> list[int]:
        """A stored fact's ids as prompt injection reads them (its wrapper positions dropped)."""
        return list(self.wrappers.unwrapped(stored)) if self.wrappers else list(stored)

    @cached_property
    def prompt_format(self) -> PromptFormat:
        return PromptFormat.from_tokenizer(self.tokenizer, self.config.instruction, self.config.closing)

    @cached_property
    def prefix_ids(self) -> list[int]:
        """The instruction prefix's token ids (the segment's first tokens)."""
        return self.prompt_format.prefix_ids(self.tokenizer)

    @cached_property
    def record(self) -> StoreOfRecord:
        """The store of record (``config.store``: the disk store, or a shared one such as Redis)."""
        return store_of_record(self.config)

    @cached_property
    def salts(self) -> CacheSalts:
        """Cache salts keyed with the server secret (``config.secret_path``, created on first use)."""
        return CacheSalts.from_file(self.config.secret_path)

    @cached_property
    def fact_id_key(self) -> bytes:
        """The key of new fact ids (:func:`make_fact_id`), derived from the server secret."""
        return fact_id_key(load_secret(self.config.secret_path))

    @cached_property
    def engine_key(self) -> str:
        """The key the engine's port answers (:mod:`inferscale.server.engine_guard`), from the secret."""
        return engine_key(load_secret(self.config.secret_path))

    @cached_property
    def session_secret(self) -> bytes:
        return load_secret(self.config.secret_path)

    def session_id(self, user_id: str) -> str:
        """The key a router keeps the user on one replica by (:mod:`inferscale.session`): no user
        id, derived with the server secret."""
        return session_key(self.session_secret, user_id)

    @cached_property
    def embedder(self):
        return build("embedder", self.config.embedder)

    @cached_property
    def retriever(self):
        """The index, rebuilt from the stored embeddings of every user."""
        retriever = build("retriever", self.config.retriever)
        self.indexed = IndexedEpochs(self.record, retriever)
        for user_id in self.record.users():
            try:
                epoch = self.record.epoch(user_id)
                ids, vectors = self.record.embeddings(user_id)
            except (CorruptDataError, ValueError) as exc:  # that user's memory is unreadable; everyone else's serves
                logger.error("memory of %r left out of the index: %s", user_id, exc)
                continue
            if ids:
                retriever.add(user_id, ids, vectors)
            self.indexed.note(user_id, epoch)
        return retriever

    @cached_property
    def erasure_listeners(self) -> list[Callable[[str], None]]:
        """Called with a user id once something of their memory is gone (a fact deleted or changed,
        the user forgotten): what holds it beyond the store drops it (the in-process engine's
        prefix cache: :class:`GenerationAPI`)."""
        return []

    def erased(self, user_id: str) -> None:
        for listener in self.erasure_listeners:
            listener(user_id)

    def retriever_for(self, user_id: str):
        """The retriever, with the user's index at the store's current version of them (another
        replica may have changed it: :mod:`inferscale.api.freshness`)."""
        self.retriever  # noqa: B018  (built first)
        return self.indexed.sync(user_id)


def erases(method):
    """A :class:`MemoryAPI` method that removes memory: once it returns, the context's erasure
    listeners are told (``user_id`` is the method's first argument)."""

    @functools.wraps(method)
    def erasing(self, user_id, *args, **kwargs):
        result = method(self, user_id, *args, **kwargs)
        self.context.erased(user_id)
        return result

    return erasing
