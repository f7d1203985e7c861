"""The memory side: a user's facts in, listed, searched, changed, out.

Every write goes through the disk store, which commits a fact whole (text,
source turn, token ids, embedding, K/V) in one atomic write; the retrieval
index follows. The fact encoder (the served model, run by transformers) is
loaded on first use and kept, so adding facts again costs no model load.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from inferscale.api.checks import fact_inputs, fact_text, top_k, user_call
from inferscale.api.context import Context, erases
from inferscale.compose.prompt import fact_token_ids
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
from inferscale.config import Config, build
from inferscale.encode.window import Turn
from inferscale.errors import CorruptDataError, MissingFactError, UnknownUserError
from inferscale.facts import Fact, make_fact_id
from inferscale.kv_fp8 import all_at_rest
from inferscale.mem0 import ExtractionError

FactInput = str | tuple[str, str | None]


@dataclass(frozen=True)
class Forgotten:
    """What forgetting a user removed."""

    user_id: str
    facts: int  # facts with their K/V and embeddings
    mem0_memories: int  # in Mem0's store or <data_dir>/mem0/vectors (their history, the session too)
    #: the user had memory stored (an unreadable one counts, with ``facts`` 0)
    found: bool = True


@dataclass(frozen=True)
class FoundFact:
    """A fact retrieved for a query, with its relevance (higher is more relevant)."""

    fact: Fact
    score: float


def extraction_tokens(config: Config) -> int:
    """The served context Mem0's extraction needs (its ≈8k-token prompt, the context it adds,
    the answer for ``config.max_facts_per_turn`` facts)."""
    from inferscale.mem0 import Mem0Extractor, context_tokens

    options = Mem0Extractor.Options(llm_base_url="http://unused/v1", store_dir="unused",
                                    max_facts_per_turn=config.max_facts_per_turn)
    return context_tokens(options.output_tokens)


class MemoryAPI:
    def __init__(self, context: Context):
        self.context = context
        self.config = context.config
        self.calibration = None
        if self.config.calibration:  # read now, so a bad file stops the start, not the first write
            from inferscale.encode.calibration import KVCalibration

            self.calibration = KVCalibration.load(self.config.calibration)
        context.wrappers  # likewise

    # ------------------------------------------------------------ writing

    @user_call
    def add_conversation(self, user_id: str, turns: Sequence[Turn], facts: Sequence[FactInput] | None = None, *,
                         llm_base_url: str | None = None, progress: bool = True) -> list[Fact]:
        """Extract → encode → store: the offline step for one user's conversation.

        ``facts`` are already-extracted statements, each optionally with the
        turn_id it came from. Without them, Mem0's extraction pipeline runs on
        ``turns`` against the OpenAI-compatible LLM at ``llm_base_url``. At most
        ``config.max_facts_per_turn`` facts are kept per turn.
        """
        facts = fact_inputs(facts) if facts is not None else None
        if facts is None:
            if llm_base_url is None:
                raise ValueError("add_conversation needs either facts or llm_base_url (to extract them with Mem0)")
            facts = self.extract_facts(user_id, turns, llm_base_url, progress=progress)
        return self.add_facts(user_id, facts, turns, progress=progress)

    @user_call
    def add_facts(self, user_id: str, facts: Sequence[FactInput], turns: Sequence[Turn] = (),
                  progress: bool = False) -> list[Fact]:
        """Store facts for a user, encoded behind the facts already stored; a fact
        given again (same id) is encoded and stored again, whole. ``facts`` is a list of
        strings or ``(text, turn_id)`` pairs, each with some text (checked first)."""
        records = self._new_facts(user_id, fact_inputs(facts))
        if records:
            self._store(user_id, records, turns, progress)
        return records

    @user_call
    @erases
    def update_fact(self, user_id: str, fact_id: str, text: str) -> Fact:
        """Replace a fact's text: a new fact, encoded again under a new id, stored and the old
        one removed in one write (a crash leaves the one or the other, never both)."""
        fact_text(text)
        old = self._require(user_id, fact_id)
        (new,) = self._new_facts(user_id, [(text, old.source_turn)])
        self._store(user_id, [new], (), False, replaced=[fact_id] if new.fact_id != fact_id else [])
        return new

    @user_call
    @erases
    def delete_fact(self, user_id: str, fact_id: str) -> None:
        self._require(user_id, fact_id)
        self.context.record.delete(user_id, [fact_id])
        self.context.retriever.delete(user_id, [fact_id])

    @user_call
    @erases
    def delete_user(self, user_id: str) -> Forgotten:
        """Forget a user: every fact with its K/V and embedding, and what Mem0's
        extraction kept (its memories, their history, the session's messages), also where
        InferScale is Mem0's vector store (``<data_dir>/mem0/vectors``)."""
        from inferscale.mem0 import forget_user

        record = self.context.record
        found = user_id in record.users()
        try:
            facts = len(record.list(user_id))
        except CorruptDataError:  # unreadable: removed all the same
            facts = 0
        record.delete(user_id)
        self.context.retriever.delete(user_id)
        mem0 = forget_user(self.config.mem0_path, user_id)
        return Forgotten(user_id, facts, mem0, found or mem0 > 0)

    @user_call
    def extract_facts(self, user_id: str, turns: Sequence[Turn], llm_base_url: str, progress: bool = True,
                      **options: Any) -> list[tuple[str, str]]:
        """Mem0's extraction, turn by turn, as ``(fact, source turn_id)``."""
        from inferscale.mem0 import Mem0Extractor

        opts = Mem0Extractor.Options(llm_base_url=llm_base_url, store_dir=str(self.config.mem0_path),
                                     max_facts_per_turn=self.config.max_facts_per_turn, **options)
        with Mem0Extractor(opts) as extractor:
            return extractor.extract(user_id, turns, progress=progress)

    # ------------------------------------------------------------ reading

    @user_call
    def list_facts(self, user_id: str) -> list[Fact]:
        """The user's facts in the order they were stored; :class:`UnknownUserError` for a user
        with none (as :meth:`search` and generation answer)."""
        facts = self.context.record.facts(user_id)
        if not facts:
            raise UnknownUserError(user_id)
        return list(facts.values())

    @user_call
    def search(self, user_id: str, query: str, k: int | None = None) -> list[FoundFact]:
        """The user's k facts most relevant to ``query``, best first (``k``: 1..1024, None: the config's)."""
        k = top_k(k)
        facts = self.context.record.facts(user_id)
        if not facts:
            raise UnknownUserError(user_id)
        retriever = self.context.retriever_for(user_id)
        hits = retriever.search(user_id, self.context.embedder.embed([query]), k or self.config.top_k)[0]
        return [FoundFact(facts[h.fact_id], h.score) for h in hits if h.fact_id in facts]

    def users(self) -> list[str]:
        return [u for u in self.context.record.users() if u != SYSTEM_USER]

    @property
    def store_description(self) -> str:
        """Where the facts are kept (for logs)."""
        describe = getattr(self.context.record, "describe", None)
        return describe() if describe else str(getattr(self.context.record, "root", self.config.kv_path))

    # ------------------------------------------------------------ internals

    @cached_property
    def encoder(self):
        """The fact encoder, loaded once and kept."""
        from inferscale.encode.encoder import FactEncoder

        window = build("window", self.config.window)
        return FactEncoder.from_spec(str(self.context.model_dir), window, dtype=self.config.model.encode_dtype,
                                     fact_style=self.config.fact_style, calibration=self.calibration,
                                     wrappers=self.context.wrappers)

    def close(self) -> None:
        if "encoder" in self.__dict__:
            self.__dict__.pop("encoder").close()

    def _store(self, user_id: str, fresh: list[Fact], turns: Sequence[Turn], progress: bool,
               replaced: Sequence[str] = ()) -> None:
        """Encode the new facts (behind the ones stored before them) and commit each whole,
        with the ``replaced`` facts removed in the same write."""
        given = {f.fact_id for f in fresh}
        # stored facts readable as text serve as context (files of format 1 have no text)
        known = [f for f in self.context.record.facts(user_id).values() if f.text and f.fact_id not in given]
        prefix = self._ensure_prefix()
        vectors = self.context.embedder.embed([f.text for f in fresh])
        related = self._related(user_id, known, fresh, vectors)
        kvs = self.encoder.encode(known + fresh, turns, progress=progress, prefix_ids=prefix, only=given,
                                  related=related)
        kvs = all_at_rest(kvs, self.config.kv_dtype_at_rest)
        self.context.record.put(user_id, kvs, {f.fact_id: f for f in fresh},
                              {f.fact_id: v for f, v in zip(fresh, vectors)}, drop=replaced)
        self.context.retriever.add(user_id, [f.fact_id for f in fresh], vectors)
        if replaced:
            self.context.retriever.delete(user_id, list(replaced))

    def _related(self, user_id: str, known: Sequence[Fact], fresh: Sequence[Fact], vectors):
        """Each new fact's related facts among the known and new ones, for a window policy that
        reads them (None otherwise): the stored embeddings of the known, the new ones' own."""
        count = self.encoder.window.related
        if not count:
            return None
        import torch

        from inferscale.encode.related import nearest

        readable = {f.fact_id for f in known}
        stored_ids, stored = self.context.record.embeddings(user_id) if known else ([], None)
        keep = [i for i, fid in enumerate(stored_ids) if fid in readable]
        ids = [stored_ids[i] for i in keep] + [f.fact_id for f in fresh]
        matrix = torch.cat([stored[keep].float(), vectors.float().cpu()]) if keep else vectors.float().cpu()
        return nearest(ids, matrix, {f.fact_id for f in fresh}, count)

    def _new_facts(self, user_id: str, facts: Sequence[FactInput]) -> list[Fact]:
        per_turn: dict[str | None, int] = defaultdict(int)
        records: dict[str, Fact] = {}
        tokenizer, style = self.context.tokenizer, self.config.fact_style
        for item in facts:
            text, source = (item, None) if isinstance(item, str) else item
            per_turn[source] += 1
            if source is not None and per_turn[source] > self.config.max_facts_per_turn:
                continue
            fid = make_fact_id(user_id, text, source, self.context.fact_id_key)
            records[fid] = Fact(fid, user_id, text, source, tuple(fact_token_ids(tokenizer, text, style)))
        return list(records.values())

    def _ensure_prefix(self) -> list[int]:
        """Encode the instruction prefix once (position 0) and store it like a fact."""
        ids, record = self.context.prefix_ids, self.context.record
        if PREFIX_FACT in record.list(SYSTEM_USER):
            (stored,) = record.token_ids(SYSTEM_USER, [PREFIX_FACT])
            if list(stored) == ids:
                return ids
        record.put(SYSTEM_USER, all_at_rest({PREFIX_FACT: self.encoder.encode_ids(ids)}, self.config.kv_dtype_at_rest))
        return ids

    def _require(self, user_id: str, fact_id: str) -> Fact:
        facts = self.context.record.facts(user_id)
        if not facts:
            raise UnknownUserError(user_id)
        if fact_id not in facts:
            raise MissingFactError(user_id, [fact_id])
        return facts[fact_id]
