"""Blending injected and recomputed memory: what of the segment is injected, and how.

Facts are encoded apart, so an injected fact never attends to the facts
before it in the segment. Two knobs trade speed for that lost attention:

* **recompute budget** (tail recompute): the whole facts at the tail of the
  segment that fit in ``recompute_tokens`` are not injected; vLLM prefills
  them with the question, so they attend to the prefix and to every injected
  fact. The composer puts the most relevant facts last, so the budget goes
  where it matters most. 0 injects the whole segment; a budget larger than
  the facts injects only the instruction prefix (prompt injection, with the
  prefix's K/V reused). On a GPU a few hundred recomputed tokens cost about
  as much as the question alone; on a CPU every token costs, hence a
  per-device default (:data:`AUTO_RECOMPUTE_TOKENS`).
* **key scale** ``c``: the injected facts' keys are multiplied by ``c``,
  which multiplies their attention logits by ``c`` — a softmax temperature
  of ``1/c`` over the injected facts only (RoPE is a rotation, so scaling
  commutes with it) — on models without a key bias. With one (``k = W x + b``,
  Qwen2) the scale also multiplies ``q · R(b)``, a term of every logit set by
  the positions alone, and shifts attention between the facts and the rest.
  The instruction prefix, exact by construction, is left alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: the recompute budget "auto" resolves to, per device type (tokens). On an H200 (Llama-3.1-8B
#: shape, CUDA graphs) recomputing 256 memory tokens costs no more than injecting them, 512 doubles
#: the TTFT (past the largest CUDA graph); on 2 CPU cores each recomputed token costs ≈ 1.5 ms,
#: so the budget there is about one short fact (benchmarks/results/ttft_budget_h200.json, README)
AUTO_RECOMPUTE_TOKENS = {"cuda": 256, "cpu": 16}
#: the budget for device types not in the table
AUTO_RECOMPUTE_FALLBACK = 0


@dataclass(frozen=True)
class Blend:
    """How a request's segment is split between injection and recompute."""

    recompute_tokens: int = 0
    key_scale: float = 1.0

    def __post_init__(self):
        if isinstance(self.recompute_tokens, bool) or not isinstance(self.recompute_tokens, int) \
                or self.recompute_tokens < 0:
            raise ValueError(f"recompute_tokens must be an integer >= 0, got {self.recompute_tokens!r}")
        if not self.key_scale > 0:
            raise ValueError(f"key_scale must be > 0, got {self.key_scale!r}")

    def override(self, recompute_tokens: int | None = None, key_scale: float | None = None) -> Blend:
        """This blend with a request's own values where it sets them."""
        return Blend(self.recompute_tokens if recompute_tokens is None else recompute_tokens,
                     self.key_scale if key_scale is None else key_scale)


def resolve_recompute_tokens(value: int | str, device_type: str) -> int:
    """A configured budget: an integer, or ``"auto"`` (by the engine's device type)."""
    if value == "auto":
        return AUTO_RECOMPUTE_TOKENS.get(device_type, AUTO_RECOMPUTE_FALLBACK)
    return Blend(value).recompute_tokens  # validates


def injected_length(part_lengths: Sequence[int], recompute_tokens: int) -> int:
    """How many leading segment tokens to inject.

    ``part_lengths`` are the token counts of the segment's parts in order: the
    instruction prefix first, then each fact. The prefix is always injected;
    the longest run of whole facts at the tail whose tokens fit in
    ``recompute_tokens`` is left to vLLM to prefill.
    """
    total = sum(part_lengths)
    tail = 0
    for length in reversed(part_lengths[1:]):
        if tail + length > recompute_tokens:
            break
        tail += length
    return total - tail
