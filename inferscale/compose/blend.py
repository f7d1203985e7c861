"""Blending injected and recomputed memory: what of the segment is injected, and how.

Facts are encoded apart, so an injected fact never attends to the facts
before it in the segment. Two knobs trade speed for that lost attention:

* **recompute budget** (tail recompute): the whole facts at the tail of the
  segment that fit in ``recompute_tokens`` are not injected; vLLM prefills
  them with the question, so they attend to the prefix and to every injected
  fact. The composer puts the most relevant facts last, so the budget goes
  where it matters most. 0 injects the whole segment; a budget larger than
  the facts injects only the instruction prefix (prompt injection, with the
  prefix's K/V reused). For a lone request on a GPU a few hundred recomputed
  tokens cost about as much as the question alone; under load each costs its
  full share of the GPU. So the budget is by default **adaptive**
  (:data:`ADAPTIVE`): a cap (per device type, :data:`AUTO_RECOMPUTE_TOKENS`)
  that a request gets only while the engine has room to prefill it, and 0
  otherwise (:mod:`inferscale.inject.load_signal` decides; the planner asks).
  ``"auto"`` is the same cap, fixed; an integer is a fixed budget.
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

#: the recompute budget "auto" resolves to, and the cap of "adaptive", per device type (tokens). On
#: an H200 (Llama-3.1-8B shape, CUDA graphs) recomputing 256 memory tokens of a lone request costs
#: no more than injecting them, 512 doubles the TTFT (past the largest CUDA graph); on 2 CPU cores
#: each recomputed token costs ≈ 1.5 ms, so the budget there is about one short fact
#: (benchmarks/results/ttft_budget_h200.json, README)
AUTO_RECOMPUTE_TOKENS = {"cuda": 256, "cpu": 16}
#: the budget for device types not in the table
AUTO_RECOMPUTE_FALLBACK = 0
#: ``recompute_tokens`` = "auto": the device's budget, for every request
AUTO = "auto"
#: ``recompute_tokens`` = "adaptive": the device's budget while the engine has room, else 0
ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class Blend:
    """How a request's segment is split between injection and recompute."""

    recompute_tokens: int = 0
    key_scale: float = 1.0
    #: ``recompute_tokens`` is a cap, spent only while the engine has room (:meth:`budget`)
    adaptive: bool = False

    def __post_init__(self):
        if isinstance(self.recompute_tokens, bool) or not isinstance(self.recompute_tokens, int) \
                or self.recompute_tokens < 0:
            raise ValueError(f"recompute_tokens must be an integer >= 0, \"auto\" or \"adaptive\", "
                             f"got {self.recompute_tokens!r}")
        if not self.key_scale > 0:
            raise ValueError(f"key_scale must be > 0, got {self.key_scale!r}")

    def override(self, recompute_tokens: int | None = None, key_scale: float | None = None) -> Blend:
        """This blend with a request's own values where it sets them (a budget it sets is fixed)."""
        scale = self.key_scale if key_scale is None else key_scale
        if recompute_tokens is None:
            return Blend(self.recompute_tokens, scale, self.adaptive)
        return Blend(recompute_tokens, scale)

    def budget(self, room: bool | None) -> int:
        """The recompute budget of one request: the cap when it is fixed or the engine has room
        (``room``), else 0."""
        return self.recompute_tokens if room or not self.adaptive else 0


def resolve_recompute_tokens(value: int | str, device_type: str) -> int:
    """A configured budget: an integer, or ``"auto"`` / ``"adaptive"`` (the device type's
    budget; for ``"adaptive"`` the cap)."""
    if value in (AUTO, ADAPTIVE):
        return AUTO_RECOMPUTE_TOKENS.get(device_type, AUTO_RECOMPUTE_FALLBACK)
    return Blend(value).recompute_tokens  # validates


def resolve_blend(recompute_tokens: int | str, key_scale: float, device_type: str) -> Blend:
    """The configured blend for an engine on ``device_type``."""
    budget = resolve_recompute_tokens(recompute_tokens, device_type)
    return Blend(budget, key_scale, adaptive=recompute_tokens == ADAPTIVE)


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
