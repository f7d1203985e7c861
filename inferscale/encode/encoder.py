"""FactEncoder: run the model over facts and keep their pre-RoPE K/V.

Each fact's token ids are ``tokenizer.encode(render_fact(text))``, placed after
the context ids its window policy chooses. Forward hooks on every attention
module record the keys **before RoPE and after any k_norm** (Qwen3, Gemma3)
and the values. Only the fact's slice is kept, on CPU, in the model's dtype,
as ``[num_layers, num_tokens, num_kv_heads, head_size]`` (:class:`FactKV`).

Shared prefills (the default on a CPU, :mod:`inferscale.encode.sharing`): the prefix
common to every row is prefilled once, every distinct context once (the facts
of one source turn share their window; a context that begins another is read
from the longer one's), and the facts run against those K/V from the model's
cache. Same tokens, same positions: the K/V equal a whole-row prefill's up to float rounding
(fp32: ≤ 2e-6 relative on the tiny models, tests/test_encoder_sharing.py). Models with
sliding-window layers (the cache's layout depends on the padding) always take whole rows.

Whole rows (``share_prefixes=False``, the default on a GPU): each ``[context | fact]`` is prefilled
in right-padded batches. One row at a time (``batch_size=1``) the K/V are
bit-identical to a plain forward over the same tokens. In padded batches the
attention kernel's summation order depends on the padded length, so results
differ from that by fp32 rounding (measured ≤ 1.3e-5 relative on
Qwen2.5-0.5B); rows of equal length stay bit-identical. Rows are sorted by
length to keep padding small.

Model introspection and the K/V hooks are in :mod:`inferscale.encode.capture`, the padded
prefills in :mod:`inferscale.encode.prefill`.

Which is faster depends on the device (``benchmarks/encode_speed.py``): on a CPU shared
prefills took 1.1-1.7x less time; on an H200 whole rows took 0.71-0.93x the time of shared
prefills (a batch costs the GPU little more than its launches). ``share_prefixes=None`` picks
by the model's device.
"""

from __future__ import annotations

import gc
from contextlib import nullcontext
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from inferscale.devices import module_device
from inferscale.encode import prefill, sharing
from inferscale.encode.capture import KVCapture as _KVCapture
from inferscale.encode.calibration import KVCalibration
from inferscale.encode.capture import attention_modules, has_sliding_window, key_biases, model_name, text_config
from inferscale.encode.fact_rows import related_ids, source_index, unique_facts
from inferscale.encode.policies import NoWindow
from inferscale.encode.prefill import Prefilled as _Prefilled
from inferscale.encode.sharing import Row as _Row
from inferscale.encode.window import Turn, WindowPolicy
from inferscale.encode.wrappers import FactWrappers
from inferscale.errors import ModelMismatchError
from inferscale.facts import Fact, render_fact
from inferscale.kv import FactKV

__all__ = ["FactEncoder", "attention_modules", "has_sliding_window", "model_name", "text_config"]


class FactEncoder:
    """Turns facts (and arbitrary token sequences) into pre-RoPE K/V.

    ``window`` chooses each fact's context (default: none); ``batch_size`` is
    the most rows one forward pass runs; ``share_prefixes`` prefills shared
    prefixes once (None: on a CPU only; see the module's docstring); ``calibration``
    corrects every fact's K/V (:mod:`inferscale.encode.calibration`; not those of
    :meth:`encode_ids`, which are read as the text they are); ``wrappers`` wrap every fact in
    learned embeddings (:mod:`inferscale.encode.wrappers`). Use as a context manager, or
    call :meth:`close`, to release the model.
    """

    def __init__(self, model: nn.Module, tokenizer, window: WindowPolicy | None = None, batch_size: int = 8,
                 fact_style: str = "bullet", share_prefixes: bool | None = None,
                 calibration: KVCalibration | None = None, wrappers: FactWrappers | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        render_fact("", fact_style)  # rejects an unknown style now
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.window = window or NoWindow()
        self.batch_size = batch_size
        self.fact_style = fact_style
        self._share = share_prefixes if not has_sliding_window(text_config(model)) else False
        self._attn = attention_modules(model)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        #: the bias in the keys it stores, ``[layers, kv_heads, head_size]`` (what a calibration keeps)
        self.key_bias = key_biases(self._attn, self.num_kv_heads, self.head_size)
        self.calibration = calibration.check(self.num_layers, self.num_kv_heads, self.head_size) if calibration else None
        self.wrappers = wrappers.check(model) if wrappers else None

    @classmethod
    def from_spec(cls, spec, window: WindowPolicy | None = None, dtype: Any = None, batch_size: int = 8,
                  fact_style: str = "bullet", share_prefixes: bool | None = None,
                  calibration: KVCalibration | None = None, wrappers: FactWrappers | None = None):
        """Load the model named by a ModelSpec / directory / GGUF / known name and wrap it."""
        from inferscale.encode.weights import load_causal_lm

        model, tokenizer = load_causal_lm(spec, dtype=dtype)
        return cls(model, tokenizer, window, batch_size, fact_style, share_prefixes, calibration, wrappers)

    @property
    def share_prefixes(self) -> bool:
        """Whether shared prefixes are prefilled once: as asked, else on a CPU only (where the
        model is now: a server may move it to a GPU after building the encoder)."""
        if self._share is not None:
            return self._share
        return module_device(self._live_model()).type == "cpu"

    # -- shape of the K/V this encoder produces

    @property
    def num_layers(self) -> int:
        return len(self._attn)

    @property
    def num_kv_heads(self) -> int:
        config = text_config(self._live_model())
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    @property
    def head_size(self) -> int:
        config = text_config(self._live_model())
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @property
    def dtype(self) -> torch.dtype:
        return self._live_model().dtype

    # -- public encoding API

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def fact_token_ids(self, fact: Fact) -> list[int]:
        """The fact's token ids; they must equal ``fact.token_ids`` when those are set."""
        ids = self.tokenize(render_fact(fact.text, self.fact_style))
        if fact.token_ids and tuple(ids) != fact.token_ids:
            raise ModelMismatchError(
                f"fact {fact.fact_id!r}: its stored token ids differ from this tokenizer's "
                f"({len(fact.token_ids)} vs {len(ids)} tokens) — was it stored with another model or fact_style?"
            )
        return ids

    def encode(self, facts: Sequence[Fact], turns: Sequence[Turn] = (), progress: bool = True,
               prefix_ids: Sequence[int] = (), only: Collection[str] | None = None,
               related: Mapping[str, Sequence[str]] | None = None) -> dict[str, FactKV]:
        """K/V of each fact, encoded behind ``prefix_ids`` and the context its window
        policy picks (from ``turns``, the facts before it or its related facts), by fact_id.

        ``prefix_ids`` (e.g. the instruction prefix the segment starts with) come
        first in every row, so a fact is encoded as it will be read: after the
        system prompt, not as the start of a sequence. ``facts`` are in the order
        they were given (the "facts" window reads the ones before each fact);
        with ``only``, just those fact_ids are encoded, the others still serving
        as context. ``related`` maps a fact_id to the ids of the facts most related
        to it (among ``facts``, the most related last; see :mod:`inferscale.encode.related`),
        for a policy that reads them (``window.related > 0``).
        """
        self._live_model()
        unique = unique_facts(facts)
        sources = source_index(turns)
        rendered = [self.fact_token_ids(fact) for fact in unique]
        prefix = tuple(prefix_ids)
        chosen = [i for i, fact in enumerate(unique) if only is None or fact.fact_id in only]
        near = related_ids(unique, rendered, chosen, related, self.window.related)
        wrap = self.wrappers.marked if self.wrappers else tuple
        rows = [self._fact_row(unique[i], turns, sources, prefix, rendered[:i], wrap(rendered[i]), near[i])
                for i in chosen]
        with tqdm(total=len(rows), desc="encoding facts", unit="fact", disable=not progress) as bar:
            with self.wrappers.applied(self.model) if self.wrappers else nullcontext():
                kvs = self._encode_rows(rows, bar)
        if self.calibration is not None:
            kvs = [self.calibration.apply(kv, self.key_bias) for kv in kvs]
        return {unique[i].fact_id: kv for i, kv in zip(chosen, kvs)}

    def encode_ids(self, token_ids: Sequence[int], context_ids: Sequence[int] = ()) -> FactKV:
        """K/V of ``token_ids`` placed after ``context_ids`` (positions start at 0)."""
        self._live_model()
        return self._encode_rows([_Row(tuple(context_ids), tuple(token_ids))])[0]

    # -- lifecycle

    def close(self) -> None:
        """Drop the model and tokenizer and free their memory."""
        self.model = self.tokenizer = None
        self._attn = []
        gc.collect()

    def __enter__(self) -> FactEncoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals

    def _live_model(self) -> nn.Module:
        if self.model is None:
            raise RuntimeError("this FactEncoder is closed")
        return self.model

    def _fact_row(self, fact: Fact, turns: Sequence[Turn], sources: dict[str, int], prefix: tuple[int, ...],
                  previous: Sequence[Sequence[int]], ids: Sequence[int], related: Sequence[Sequence[int]]) -> _Row:
        source = None
        if fact.source_turn is not None and turns:
            if fact.source_turn not in sources:
                raise ValueError(
                    f"fact {fact.fact_id!r}: source turn {fact.source_turn!r} is not among the {len(turns)} turns given"
                )
            source = sources[fact.source_turn]
        context = self.window.context_ids(turns, source, self.tokenize, previous, related)
        return _Row(prefix + tuple(context), tuple(ids))

    def _encode_rows(self, rows: Sequence[_Row], bar=None) -> list[FactKV]:
        """Encode rows (shared prefills or whole rows); results in the input order."""
        if self.share_prefixes:
            return self._encode_shared(rows, bar)
        return self._encode_whole(rows, bar)

    def _encode_whole(self, rows: Sequence[_Row], bar=None) -> list[FactKV]:
        """Each row prefilled whole, in batches of similar length."""
        order = sorted(range(len(rows)), key=lambda i: -rows[i].length)
        out: list[FactKV | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            batch = [rows[i] for i in chunk]
            seqs = [row.context + row.ids for row in batch]
            for i, kv in zip(chunk, self._capture(None, seqs, [len(row.context) for row in batch])):
                out[i] = kv
            if bar is not None:
                bar.update(len(chunk))
        return out  # type: ignore[return-value]

    def _encode_shared(self, rows: Sequence[_Row], bar=None) -> list[FactKV]:
        """The base prefilled once; per chunk, its hosts once, then its facts against them."""
        plan = sharing.plan(rows, self.batch_size)
        base = self._run(None, [plan.base]) if plan.base else None
        out: list[FactKV | None] = [None] * len(rows)
        for chunk in plan.chunks:
            for i, kv in zip(chunk.rows, self._encode_chunk(base, chunk, rows)):
                out[i] = kv
            if bar is not None:
                bar.update(len(chunk.rows))
        return out  # type: ignore[return-value]

    def _encode_chunk(self, base: _Prefilled | None, chunk: sharing.Chunk, rows: Sequence[_Row]) -> list[FactKV]:
        """The chunk's hosts prefilled together, then its facts ``batch_size`` at a time."""
        hosts = self._prefill_hosts(base, chunk.hosts)
        out: list[FactKV] = []
        for start in range(0, len(chunk.rows), self.batch_size):
            batch = [rows[i] for i in chunk.rows[start : start + self.batch_size]]
            host_of = chunk.host_of[start : start + self.batch_size]
            past = hosts.rows(host_of, [len(row.context) for row in batch]) if hosts else None
            out += self._capture(past, [row.ids for row in batch], [0] * len(batch))
        return out

    def _prefill_hosts(self, base: _Prefilled | None, hosts: Sequence[tuple[int, ...]]) -> _Prefilled | None:
        """``[base | host]`` for every host, one row each (None when both are empty)."""
        past = base.rows([0] * len(hosts), [base.width] * len(hosts)) if base else None
        return self._run(past, hosts) if any(hosts) else past

    def _capture(self, past: _Prefilled | None, seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> list[FactKV]:
        """Run ``seqs`` after ``past``; each row's K/V from ``starts[b]`` to its end."""
        width = max(len(seq) for seq in seqs)
        if width == 0:
            return [self._empty_kv() for _ in seqs]
        capture = _KVCapture(self._attn, self.num_kv_heads, self.head_size)
        capture.seq = width
        with capture:
            self._forward(past, seqs, keep_cache=False)
        return [self._slice(capture, b, start, seq) for b, (start, seq) in enumerate(zip(starts, seqs))]

    def _run(self, past: _Prefilled | None, seqs: Sequence[Sequence[int]]) -> _Prefilled:
        """``past`` extended by ``seqs``: the model's cache after them."""
        assert past is None or all(n == past.width for n in past.lengths), "rows to extend must be unpadded"
        cache = self._forward(past, seqs)
        lengths = past.lengths if past else (0,) * len(seqs)
        layers = tuple((layer.keys, layer.values) for layer in cache.layers)
        return _Prefilled(layers, tuple(n + len(seq) for n, seq in zip(lengths, seqs)))

    def _forward(self, past: _Prefilled | None, seqs: Sequence[Sequence[int]], keep_cache: bool = True):
        """:func:`inferscale.encode.prefill.forward` with this encoder's model and pad id."""
        return prefill.forward(self._live_model(), past, seqs, self._pad_id, keep_cache)

    def _slice(self, capture: _KVCapture, b: int, start: int, seq: Sequence[int]) -> FactKV:
        dtype = self.dtype

        def gather(store: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([t[b, start : len(seq)] for t in store]).to("cpu", dtype).contiguous()

        ids = self.wrappers.stored(seq[start:]) if self.wrappers else tuple(seq[start:])
        return FactKV(ids, gather(capture.keys), gather(capture.values))

    def _empty_kv(self) -> FactKV:
        shape = (self.num_layers, 0, self.num_kv_heads, self.head_size)
        return FactKV((), torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype))
