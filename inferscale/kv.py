"""K/V tensors of facts, as the core passes them around.

Layout (every tensor here): ``[num_layers, num_tokens, num_kv_heads, head_size]``.
Keys are stored **before RoPE** (after any k_norm), so a fact can be placed at
any position later (see :mod:`inferscale.compose.rope`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: token ids are vocabulary indices: 0 <= id < 2**63 (cache salts hash them as int64)
TOKEN_ID_LIMIT = 1 << 63


def token_ids_valid(ids) -> bool:
    """Whether every id is an int (not a bool) in ``0 <= id < TOKEN_ID_LIMIT``."""
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < TOKEN_ID_LIMIT for t in ids)


@dataclass
class FactKV:
    """One fact's pre-RoPE keys and values, with the token ids they belong to."""

    token_ids: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor

    def __post_init__(self):
        self.token_ids = tuple(int(t) for t in self.token_ids)
        if not token_ids_valid(self.token_ids):
            raise ValueError(f"token ids must lie in 0..2**63-1, got {self.token_ids[:8]}...")
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(
                f"keys and values must both be [layers, tokens, kv_heads, head_size], "
                f"got {tuple(self.keys.shape)} and {tuple(self.values.shape)}"
            )
        if self.keys.shape[1] != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids for {self.keys.shape[1]} K/V tokens")
        if self.keys.dtype != self.values.dtype:
            raise ValueError(f"keys are {self.keys.dtype} but values are {self.values.dtype}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass
class KVBatch:
    """Several facts gathered in request order, concatenated along the token axis.

    ``keys[l]`` and ``values[l]`` are contiguous per layer. Fact ``i`` occupies
    tokens ``offsets[i]:offsets[i + 1]``.
    """

    fact_ids: list[str]
    token_ids: list[tuple[int, ...]]
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def offsets(self) -> list[int]:
        out = [0]
        for ids in self.token_ids:
            out.append(out[-1] + len(ids))
        return out

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    def flat_token_ids(self) -> list[int]:
        return [t for ids in self.token_ids for t in ids]
