"""The shape of a user's K/V (:class:`KVLayout`) and the checks every store makes on what it is given."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from inferscale.errors import MissingFactError, ModelMismatchError
from inferscale.facts import INTERNAL_PREFIX, check_id_list, check_stored_user_id, is_internal
from inferscale.kv import FactKV
from inferscale.kv_fp8 import DEQUANT_DTYPE, FP8, FP8_E4M3, MODEL, Fp8KV, check_at_rest


@dataclass(frozen=True)
class KVLayout:
    """What every fact of one user shares: the model's K/V geometry and dtype, and the form they are
    kept in (``at_rest``: the model's dtype, or fp8 with a dequant per fact, :mod:`inferscale.kv_fp8`)."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    at_rest: str = MODEL

    @classmethod
    def of(cls, kv: FactKV | Fp8KV) -> KVLayout:
        layers, _, heads, size = kv.keys.shape
        if isinstance(kv, Fp8KV):
            return cls(int(layers), int(heads), int(size), kv.dtype, FP8_E4M3)
        return cls(int(layers), int(heads), int(size), kv.keys.dtype)

    @property
    def dtype_name(self) -> str:
        """``"bfloat16"``, ``"float32"``, ... (``torch.<name>``)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def fp8(self) -> bool:
        """Whether the K/V are kept in fp8 (:class:`~inferscale.kv_fp8.Fp8KV`)."""
        return self.at_rest == FP8_E4M3

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype of the kept K/V's elements: e4m3 in fp8, else the model's."""
        return FP8 if self.fp8 else self.dtype

    def kept_as(self, at_rest: str) -> KVLayout:
        """The same K/V kept in the form ``at_rest``."""
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_size, self.dtype, check_at_rest(at_rest))

    def block_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        return (2, self.num_layers, num_tokens, self.num_kv_heads, self.head_size)

    def dequant_shape(self) -> tuple[int, int, int, int]:
        """An fp8 fact's offsets and scales (:attr:`~inferscale.kv_fp8.Fp8KV.dequant`)."""
        return (2, self.num_layers, self.num_kv_heads, self.head_size + 1)

    def token_numel(self) -> int:
        """Elements of K plus V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size

    def token_nbytes(self) -> int:
        return self.token_numel() * self.stored_dtype.itemsize

    def fact_nbytes(self) -> int:
        """Bytes a fact keeps beside its tokens' (an fp8 fact's dequant; 0 in the model's dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_size + 1) * DEQUANT_DTYPE.itemsize \
            if self.fp8 else 0

    def nbytes(self, lengths) -> int:
        """Bytes kept for facts of ``lengths`` tokens each."""
        lengths = list(lengths)
        return sum(lengths) * self.token_nbytes() + len(lengths) * self.fact_nbytes()

    def describe(self) -> str:
        return (
            f"{self.num_layers} layers x {self.num_kv_heads} kv heads x head size "
            f"{self.head_size}, {self.dtype_name}" + (" (at rest in fp8_e4m3)" if self.fp8 else "")
        )

    def to_dict(self) -> dict:
        """As files store it; ``at_rest`` only where it is fp8 (the model's dtype is written as before)."""
        out = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "dtype": self.dtype_name,
        }
        return {**out, "at_rest": self.at_rest} if self.fp8 else out

    @classmethod
    def from_dict(cls, data: Mapping) -> KVLayout:
        """Inverse of :meth:`to_dict`; raises ValueError on anything malformed."""
        dtype = getattr(torch, str(data["dtype"]), None)
        if not isinstance(dtype, torch.dtype) or dtype == FP8:
            raise ValueError(f"unknown dtype {data['dtype']!r}")
        dims = [data["num_layers"], data["num_kv_heads"], data["head_size"]]
        if not all(isinstance(d, int) and d > 0 for d in dims):
            raise ValueError(f"bad layout dimensions {dims}")
        at_rest = data.get("at_rest", MODEL)
        if at_rest == MODEL and "at_rest" in data:
            raise ValueError("a layout in the model's dtype does not name it")  # (one encoding per layout)
        return cls(*dims, dtype, check_at_rest(at_rest))


__all__ = ["INTERNAL_PREFIX", "KVLayout", "check_ids", "check_layout", "is_internal", "require_facts"]


def check_ids(user_id: str, fact_ids: Iterable[str]) -> None:
    """User ids as Mem0 takes them, in NFC (directory and file names escape them); fact ids short
    ASCII names (they become file and tensor names)."""
    check_stored_user_id(user_id)
    check_id_list(list(fact_ids), "fact_id")


def check_layout(user_id: str, facts: Mapping[str, FactKV | Fp8KV], expected: KVLayout | None) -> KVLayout | None:
    """The layout ``facts`` share with ``expected`` (the user's stored facts).

    Raises :class:`ModelMismatchError` naming the first fact that differs.
    Returns ``expected`` unchanged when ``facts`` is empty.
    """
    for fact_id, kv in facts.items():
        if not isinstance(kv, (FactKV, Fp8KV)):
            raise TypeError(f"fact {fact_id!r}: expected a FactKV or Fp8KV, got {type(kv).__name__}")
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
