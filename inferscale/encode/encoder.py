"""FactEncoder: run the model over facts and keep their pre-RoPE K/V.

Each fact's token ids are ``tokenizer.encode(render_fact(text))``, placed after
the context ids its window policy chooses. Rows are right-padded into batches
and run once through the decoder; forward hooks on every attention module
record the keys **before RoPE and after any k_norm** (Qwen3, Gemma3) and the
values. Only the fact's slice is kept, on CPU, in the model's dtype, as
``[num_layers, num_tokens, num_kv_heads, head_size]`` (:class:`FactKV`).

One row at a time (``batch_size=1``) the K/V are bit-identical to a plain
forward over the same tokens. In padded batches the attention kernel's
summation order depends on the padded length, so results differ from that by
fp32 rounding (measured ≤ 1.3e-5 relative on Qwen2.5-0.5B); rows of equal
length stay bit-identical. Rows are sorted by length to keep padding small.
"""

from __future__ import annotations

import gc
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from inferscale.encode.policies import NoWindow
from inferscale.encode.window import Turn, WindowPolicy
from inferscale.errors import ModelMismatchError
from inferscale.facts import Fact, render_fact
from inferscale.kv import FactKV


@dataclass(frozen=True)
class _Row:
    """One sequence to run: ``context`` ids, then the ``ids`` whose K/V we keep."""

    context: tuple[int, ...]
    ids: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.context) + len(self.ids)


# ---------------------------------------------------------------- model introspection


def text_config(model: nn.Module):
    """The decoder's config (multimodal models nest it)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_name(model: nn.Module) -> str:
    return f"{type(model).__name__} ({getattr(text_config(model), 'model_type', '?')})"


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The decoder's attention modules in layer order; each must have k_proj and v_proj."""
    found = [
        m
        for m in model.modules()
        if isinstance(getattr(m, "k_proj", None), nn.Module)
        and isinstance(getattr(m, "v_proj", None), nn.Module)
        and isinstance(getattr(m, "layer_idx", None), int)
    ]
    expected = text_config(model).num_hidden_layers
    if not found:
        raise ModelMismatchError(
            f"{model_name(model)} is not supported by the fact encoder: no attention module with "
            f"separate k_proj / v_proj projections (fused QKV projections are not supported)"
        )
    if len(found) != expected:
        raise ModelMismatchError(
            f"{model_name(model)}: found {len(found)} attention modules with k_proj/v_proj, "
            f"but the config has {expected} layers"
        )
    return sorted(found, key=lambda m: m.layer_idx)


def _to_bthd(out: torch.Tensor, inp: torch.Tensor, seq: int, heads: int) -> torch.Tensor:
    """A hooked output as ``[batch, seq, heads, head_size]``.

    Projections give ``[B, T, H*D]``; norms get a ``[B, T, H, D]`` view (Qwen3)
    or its ``[B, H, T, D]`` transpose (Gemma3): when T == H the input's strides
    tell which.
    """
    if out.dim() == 3:
        return out.unflatten(-1, (heads, -1))
    if seq == heads:
        heads_first = inp.stride(1) < inp.stride(2)
    else:
        heads_first = out.shape[1] == heads
    return out.transpose(1, 2) if heads_first else out


def _last_stage(attn: nn.Module, norm: str, proj: str) -> nn.Module:
    """The module whose output is the cached tensor before RoPE: the norm if any."""
    module = getattr(attn, norm, None)
    return module if isinstance(module, nn.Module) else getattr(attn, proj)


class _KVCapture:
    """Forward hooks recording every layer's pre-RoPE keys and values for one batch."""

    def __init__(self, attn: Sequence[nn.Module], num_kv_heads: int, head_size: int):
        self.attn, self.num_kv_heads, self.head_size = list(attn), num_kv_heads, head_size
        self.keys: list[torch.Tensor | None] = [None] * len(self.attn)
        self.values: list[torch.Tensor | None] = [None] * len(self.attn)
        self.seq = 0
        self._handles: list[Any] = []

    def __enter__(self) -> _KVCapture:
        for i, module in enumerate(self.attn):
            k_src = _last_stage(module, "k_norm", "k_proj")
            v_src = _last_stage(module, "v_norm", "v_proj")
            self._handles.append(k_src.register_forward_hook(self._hook(self.keys, i)))
            self._handles.append(v_src.register_forward_hook(self._hook(self.values, i)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, store: list, layer: int):
        def hook(module, args, output):
            out = _to_bthd(output, args[0], self.seq, self.num_kv_heads)
            if out.shape[1:] != (self.seq, self.num_kv_heads, self.head_size):
                raise ModelMismatchError(
                    f"layer {layer}: captured {tuple(output.shape)}, expected "
                    f"[batch, {self.seq}, {self.num_kv_heads}, {self.head_size}]"
                )
            store[layer] = out.detach()

        return hook


# ---------------------------------------------------------------- the encoder


class FactEncoder:
    """Turns facts (and arbitrary token sequences) into pre-RoPE K/V.

    ``window`` chooses each fact's context (default: none). Use as a context
    manager, or call :meth:`close`, to release the model.
    """

    def __init__(self, model: nn.Module, tokenizer, window: WindowPolicy | None = None, batch_size: int = 8,
                 fact_style: str = "bullet"):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        render_fact("", fact_style)  # rejects an unknown style now
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.window = window or NoWindow()
        self.batch_size = batch_size
        self.fact_style = fact_style
        self._attn = attention_modules(model)
        self._pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    @classmethod
    def from_spec(cls, spec, window: WindowPolicy | None = None, dtype: Any = None, batch_size: int = 8,
                  fact_style: str = "bullet"):
        """Load the model named by a ModelSpec / directory / GGUF / known name and wrap it."""
        from inferscale.encode.weights import load_causal_lm

        model, tokenizer = load_causal_lm(spec, dtype=dtype)
        return cls(model, tokenizer, window, batch_size, fact_style)

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
               prefix_ids: Sequence[int] = (), only: Collection[str] | None = None) -> dict[str, FactKV]:
        """K/V of each fact, encoded behind ``prefix_ids`` and the context its window
        policy picks (from ``turns`` or from the facts before it), by fact_id.

        ``prefix_ids`` (e.g. the instruction prefix the segment starts with) come
        first in every row, so a fact is encoded as it will be read: after the
        system prompt, not as the start of a sequence. ``facts`` are in the order
        they were given (the "facts" window reads the ones before each fact);
        with ``only``, just those fact_ids are encoded, the others still serving
        as context.
        """
        self._live_model()
        unique = _unique_facts(facts)
        sources = _source_index(turns)
        rendered = [self.fact_token_ids(fact) for fact in unique]
        prefix = tuple(prefix_ids)
        chosen = [i for i, fact in enumerate(unique) if only is None or fact.fact_id in only]
        rows = [self._fact_row(unique[i], turns, sources, prefix, rendered[:i], rendered[i]) for i in chosen]
        with tqdm(total=len(rows), desc="encoding facts", unit="fact", disable=not progress) as bar:
            kvs = self._encode_rows(rows, bar)
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
                  previous: Sequence[Sequence[int]], ids: Sequence[int]) -> _Row:
        source = None
        if fact.source_turn is not None and turns:
            if fact.source_turn not in sources:
                raise ValueError(
                    f"fact {fact.fact_id!r}: source turn {fact.source_turn!r} is not among the {len(turns)} turns given"
                )
            source = sources[fact.source_turn]
        context = self.window.context_ids(turns, source, self.tokenize, previous)
        return _Row(prefix + tuple(context), tuple(ids))

    def _encode_rows(self, rows: Sequence[_Row], bar=None) -> list[FactKV]:
        """Encode rows in batches of similar length; results in the input order."""
        order = sorted(range(len(rows)), key=lambda i: -rows[i].length)
        out: list[FactKV | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, kv in zip(chunk, self._encode_batch([rows[i] for i in chunk])):
                out[i] = kv
            if bar is not None:
                bar.update(len(chunk))
        return out  # type: ignore[return-value]

    def _encode_batch(self, rows: Sequence[_Row]) -> list[FactKV]:
        """One forward pass over right-padded rows; each row's fact slice as FactKV."""
        model = self._live_model()
        input_ids, mask, positions = self._pad(rows)
        capture = _KVCapture(self._attn, self.num_kv_heads, self.head_size)
        capture.seq = input_ids.shape[1]
        if capture.seq == 0:
            return [self._empty_kv() for _ in rows]
        device = next(model.parameters()).device
        with torch.no_grad(), capture:
            model.base_model(
                input_ids=input_ids.to(device),
                attention_mask=mask.to(device),
                position_ids=positions.to(device),
                use_cache=False,
            )
        return [self._slice(capture, b, row) for b, row in enumerate(rows)]

    def _pad(self, rows: Sequence[_Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ids, attention mask and position ids (0..len-1 in every row)."""
        width = max(row.length for row in rows)
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            input_ids[b, : row.length] = torch.tensor(row.context + row.ids, dtype=torch.long)
            mask[b, : row.length] = 1
        positions = torch.arange(width).expand(len(rows), width)
        # right padding: the real tokens of every row sit at positions 0..len-1
        assert torch.equal((mask.cumsum(-1) - 1).clamp(min=0) * mask, positions * mask)
        return input_ids, mask, positions

    def _slice(self, capture: _KVCapture, b: int, row: _Row) -> FactKV:
        start, end = len(row.context), row.length
        dtype = self.dtype

        def gather(store: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([t[b, start:end] for t in store]).to("cpu", dtype).contiguous()

        return FactKV(row.ids, gather(capture.keys), gather(capture.values))

    def _empty_kv(self) -> FactKV:
        shape = (self.num_layers, 0, self.num_kv_heads, self.head_size)
        return FactKV((), torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype))


def _unique_facts(facts: Sequence[Fact]) -> list[Fact]:
    """Facts with duplicate fact_ids dropped (the same id must mean the same text)."""
    seen: dict[str, Fact] = {}
    for fact in facts:
        other = seen.setdefault(fact.fact_id, fact)
        if other.text != fact.text:
            raise ValueError(f"fact_id {fact.fact_id!r} is given twice with different texts")
    return list(seen.values())


def _source_index(turns: Sequence[Turn]) -> dict[str, int]:
    """turn_id → index of its first occurrence."""
    index: dict[str, int] = {}
    for i, turn in enumerate(turns):
        index.setdefault(turn.turn_id, i)
    return index
