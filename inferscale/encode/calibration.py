"""KVCalibration: a correction of facts' stored K/V, fitted offline against prompt injection.

A fact is encoded behind a few other facts, not behind the ones a request reads it with, so a
question after injected facts meets keys and values a little unlike those after the same facts
as text. A calibration corrects them once, at encoding, with no per-request cost:

    k' = b + c ⊙ (k − b) + δk        v' = s ⊙ v + δv

per layer and KV head (``c``, ``s`` of shape ``[layers, kv_heads]``: the ``head`` form) or per
channel of each head (``[layers, kv_heads, head_size]``, with the shifts ``δk``, ``δv``: the
``channel`` form). ``b`` is the key projection's bias (the stored keys are taken before RoPE;
it is zero where the model has none or normalizes its keys after projecting), so ``c`` is a
temperature on what the keys say that leaves the bias's positional term alone. RoPE is applied
after, at compose time, so relocation stays exact.

The file is JSON (``benchmarks/kv_calibration.py`` fits and writes it): ``key_scale`` and
``value_scale`` as nested lists, optionally ``key_shift`` and ``value_shift``
(``[layers][kv_heads][head_size]``) and ``model``, the name of the model it was fitted for.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from inferscale.errors import ConfigError, ModelMismatchError
from inferscale.kv import FactKV

FORMS = ("head", "channel")


def corrected(keys: torch.Tensor, values: torch.Tensor, key_bias: torch.Tensor, key_scale, value_scale,
              key_shift: torch.Tensor | None = None, value_shift: torch.Tensor | None = None):
    """``keys`` / ``values`` ``[layers, tokens, kv_heads, head_size]`` through the correction.

    ``key_bias`` is ``[layers, kv_heads, head_size]``; a scale is a number, ``[layers, kv_heads]``
    or ``[layers, kv_heads, head_size]``; a shift is ``[layers, kv_heads, head_size]`` or None.
    Gradients reach tensor arguments (the fit goes through this function)."""
    b = key_bias.to(keys)[:, None]
    k = b + _per_token(key_scale, keys) * (keys - b)
    v = _per_token(value_scale, values) * values
    if key_shift is not None:
        k = k + key_shift.to(keys)[:, None]
    if value_shift is not None:
        v = v + value_shift.to(values)[:, None]
    return k, v


def _per_token(scale, like: torch.Tensor):
    """A scale broadcast over the token axis of ``like``."""
    if not isinstance(scale, torch.Tensor):
        return scale
    scale = scale.to(like)
    return scale[:, None, :, None] if scale.dim() == 2 else scale[:, None]


@dataclass(frozen=True, eq=False)
class KVCalibration:
    """A fitted correction (see the module docstring); :meth:`load` reads and checks a file."""

    key_scale: torch.Tensor
    value_scale: torch.Tensor
    key_shift: torch.Tensor | None = None
    value_shift: torch.Tensor | None = None
    model: str = ""
    source: str = ""

    @property
    def form(self) -> str:
        return "head" if self.key_scale.dim() == 2 else "channel"

    @property
    def shape(self) -> tuple[int, int]:
        """(layers, kv_heads)"""
        return tuple(self.key_scale.shape[:2])  # type: ignore[return-value]

    @classmethod
    def load(cls, path: str | os.PathLike) -> KVCalibration:
        """Read a calibration file; a file that is not one raises :class:`ConfigError`."""
        where = str(path)
        try:
            data = json.loads(Path(os.path.expanduser(where)).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"calibration {where}: {exc}") from None
        if not isinstance(data, dict) or "key_scale" not in data or "value_scale" not in data:
            raise ConfigError(f"calibration {where}: expected a JSON object with key_scale and value_scale")
        tensors = {name: _tensor(data.get(name), name, where) for name in ("key_scale", "value_scale", "key_shift", "value_shift")}
        calibration = cls(**tensors, model=str(data.get("model", "")), source=where)
        calibration._check(where)
        return calibration

    def _check(self, where: str) -> None:
        k, v = self.key_scale, self.value_scale
        if k.dim() not in (2, 3) or k.shape != v.shape:
            raise ConfigError(f"calibration {where}: key_scale {tuple(k.shape)} and value_scale {tuple(v.shape)} must "
                              f"both be [layers, kv_heads] or [layers, kv_heads, head_size]")
        if not (bool((k > 0).all()) and bool((v > 0).all())):
            raise ConfigError(f"calibration {where}: scales must be positive")
        for name in ("key_shift", "value_shift"):
            shift = getattr(self, name)
            if shift is not None and (shift.dim() != 3 or shift.shape[:2] != k.shape[:2]
                                      or (k.dim() == 3 and shift.shape != k.shape)):
                raise ConfigError(f"calibration {where}: {name} {tuple(shift.shape)} must be "
                                  f"[layers, kv_heads, head_size] for scales {tuple(k.shape)}")

    def check(self, num_layers: int, num_kv_heads: int, head_size: int) -> KVCalibration:
        """Self, if it fits K/V of this shape; else :class:`ModelMismatchError`."""
        sizes = {t.shape[2] for t in (self.key_scale, self.key_shift, self.value_shift) if t is not None and t.dim() == 3}
        if self.shape != (num_layers, num_kv_heads) or sizes - {head_size}:
            fitted = f"{self.shape[0]} layers x {self.shape[1]} KV heads" + (f" x {sizes.pop()}" if sizes else "")
            raise ModelMismatchError(f"calibration {self.source or '(in memory)'} was fitted for {fitted}"
                                     f"{f' ({self.model})' if self.model else ''}; this model has {num_layers} x "
                                     f"{num_kv_heads} x {head_size}")
        return self

    def apply(self, kv: FactKV, key_bias: torch.Tensor) -> FactKV:
        """``kv`` corrected (computed in float32, stored back in its dtype)."""
        self.check(kv.keys.shape[0], kv.keys.shape[2], kv.keys.shape[3])
        keys, values = corrected(kv.keys.float(), kv.values.float(), key_bias.float(), self.key_scale,
                                 self.value_scale, self.key_shift, self.value_shift)
        return FactKV(kv.token_ids, keys.to(kv.keys.dtype), values.to(kv.values.dtype))

    def to_dict(self) -> dict:
        out = {"form": self.form, "model": self.model, "key_scale": self.key_scale.tolist(),
               "value_scale": self.value_scale.tolist()}
        for name in ("key_shift", "value_shift"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).tolist()
        return out


def _tensor(value, name: str, where: str) -> torch.Tensor | None:
    if value is None:
        return None
    try:
        tensor = torch.tensor(value, dtype=torch.float32)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"calibration {where}: {name} is not a rectangular list of numbers ({exc})") from None
    if not bool(torch.isfinite(tensor).all()):
        raise ConfigError(f"calibration {where}: {name} holds a value that is not finite")
    return tensor
