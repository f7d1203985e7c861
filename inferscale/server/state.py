"""What the front's routes share: the memory and generation sides, the engine, the metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import httpx

from inferscale.api import Context, GenerationAPI, MemoryAPI
from inferscale.server.metrics import FrontMetrics
from inferscale.server.memory.write_queue import FairLock, UserLocks

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    memory: MemoryAPI
    generation: GenerationAPI
    #: the engine's base URL on loopback, e.g. http://127.0.0.1:41234
    engine_url: str
    #: the model name the engine serves (what chat requests may name)
    served_model: str
    metrics: FrontMetrics = field(default_factory=FrontMetrics)
    #: clients must send ``Authorization: Bearer <api_key>`` when set
    api_key: str | None = None
    #: memory writes take turns, in arrival order (one encoder, one Mem0 store)
    write_lock: FairLock = field(default_factory=FairLock)
    #: one user's writes stay in order while a large add of theirs takes several turns
    user_locks: UserLocks = field(default_factory=UserLocks)
    client: httpx.AsyncClient | None = None
    #: forgetting a user, deleting or changing a fact also empties the engine's prefix cache
    #: (``--forget-resets-prefix-cache``)
    forget_resets_prefix_cache: bool = False
    #: other names a chat may give the served model (the model as named on the command line)
    model_aliases: frozenset[str] = frozenset()
    #: seconds a chat is sent again while no replica answers (a router's replica died: :mod:`failover`)
    engine_retry_s: float = 0.0

    @property
    def engine_key(self) -> str:
        """What the engine's port answers (:mod:`inferscale.server.engine_guard`)."""
        return self.memory.context.engine_key

    def engine_model(self, named: object) -> object:
        """The model name to send the engine for the one a chat named."""
        return self.served_model if named is None or (isinstance(named, str) and named in self.model_aliases) \
            else named

    @classmethod
    def build(cls, context: Context, engine_url: str, served_model: str, api_key: str | None = None) -> ServerState:
        """Both sides of the API over one context."""
        return cls(MemoryAPI(context), GenerationAPI(context), engine_url, served_model, api_key=api_key)

    @property
    def engine_v1(self) -> str:
        return f"{self.engine_url}/v1"

    def warm_up(self, encoder: bool = True) -> None:
        """Remove what writes interrupted by a crash left on disk; build the tokenizer, embedder,
        index (and the encoder) now, once, before serving."""
        start = time.perf_counter()
        context = self.memory.context
        swept = context.record.sweep()
        if swept:
            logger.info("memory: removed what interrupted writes left for %d user(s)", len(swept))
        context.prefix_ids  # noqa: B018  (the tokenizer and the prompt layout)
        context.embedder.embed(["warm up"])  # loads the embedding model
        users = self.memory.users()
        context.retriever  # noqa: B018  (rebuilt from every user's stored embeddings)
        self.generation.composer  # noqa: B018
        logger.info("memory: %d user(s) in %s; index and embedder ready in %.1f s", len(users),
                    self.memory.store_description, time.perf_counter() - start)
        if encoder:
            start = time.perf_counter()
            self.memory.encoder  # noqa: B018
            logger.info("fact encoder (%s) loaded in %.1f s", context.model_dir.name, time.perf_counter() - start)

    def close(self) -> None:
        self.memory.close()
