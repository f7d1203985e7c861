"""The shape of a user's K/V (:class:`KVLayout`) and the checks every store makes on what it is given."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from inferscale.errors import MissingFactError, ModelMismatchError
from inferscale.facts import INTERNAL_PREFIX, check_id_list, check_stored_user_id, is_internal
from inferscale.kv import FactKV


@dataclass(frozen=True)
class KVLayout:
    """What every fact of one user shares: the model's K/V geometry and dtype."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @classmethod
    def of(cls, kv: FactKV) -> KVLayout:
        layers, _, heads, size = kv.keys.shape
        return cls(int(layers), int(heads), int(size), kv.keys.dtype)

    @property
    def dtype_name(self) -> str:
        """``"bfloat16"``, ``"float32"``, ... (``torch.<name>``)."""
        return str(self.dtype).removeprefix("torch.")

    def block_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, num_tokens, self.num_kv_heads, self.head_size)

    def token_numel(self) -> int:
        """Elements of K plus V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size

    def token_nbytes(self) -> int:
        return self.token_numel() * self.dtype.itemsize

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} kv heads x head size "
            f"{self.head_size}, {self.dtype_name}"
        )

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype_name,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> KVLayout:
        """Inverse of :meth:`to_dict`; raises ValueError on anything malformed."""
        dtype = getattr(torch, str(data["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {data['dtype']!r}")
        dims = [data["num_layers"], data["num_kv_heads"], data["head_size"]]
        if not all(isinstance(d, int) and d > 0 for d in dims):
            raise ValueError(f"bad layout dimensions {dims}")
        return cls(*dims, dtype)


__all__ = ["INTERNAL_PREFIX", "KVLayout", "check_ids", "check_layout", "is_internal", "require_facts"]


def check_ids(user_id: str, fact_ids: Iterable[str]) -> None:
    """User ids as Mem0 takes them, in NFC (directory and file names escape them); fact ids short
    ASCII names (they become file and tensor names)."""
    check_stored_user_id(user_id)
    check_id_list(list(fact_ids), "fact_id")


def check_layout(user_id: str, facts: Mapping[str, FactKV], expected: KVLayout | None) -> KVLayout | None:
    """The layout ``facts`` share with ``expected`` (the user's stored facts).

    Raises :class:`ModelMismatchError` naming the first fact that differs.
    Returns ``expected`` unchanged when ``facts`` is empty.
    """
    for fact_id, kv in facts.items():
        if not isinstance(kv, FactKV):
            raise TypeError(f"fact {fact_id!r}: expected a FactKV, got {type(kv).__name__}")
        got = KVLayout.of(kv)
        if expected is None:
            expected = got
        elif got != expected:
            raise ModelMismatchError(
                f"user {user_id!r}: fact {fact_id!r} is {got.describe()} but the user's "
                f"facts are {expected.describe()}"
            )
    return expected


def require_facts(user_id: str, fact_ids: Sequence[str], known: Mapping[str, object]) -> None:
    """Raise :class:`MissingFactError` listing every requested id not in ``known``."""
    missing = {f for f in fact_ids if f not in known}
    if missing:
        raise MissingFactError(user_id, missing)
