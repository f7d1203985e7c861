"""FactWrappers: learned input embeddings that wrap every fact when it is encoded.

A fact is encoded apart from the facts a request reads it with, so a question after injected
facts meets K/V a little unlike those after the same facts as text. Wrappers (after KV Packet,
arXiv 2604.13226) spend a few trained embeddings per fact to close that gap, with the model
frozen and nothing recomputed at request time: ``header`` vectors go before the fact's tokens and
``trailer`` vectors after them, the whole run is encoded offline behind the fact's window, and
its K/V are stored and injected like the fact's own. The trailer's K/V summarise the fact for
the question; a header also changes the fact's own K/V (it sits in their context).

In the stored token ids a wrapper position holds ``filler_id``, a space (the connector matches the
prompt against the stored ids, a fact that vLLM recomputes at the segment's tail reads the filler
as text, and prompt injection drops it: :meth:`FactWrappers.unwrapped`). The vectors are trained by distillation against prompt injection
(``benchmarks/train_wrappers.py``), on facts the model writes itself, and are stored per model
as a small safetensors file: ``header`` ``[h, hidden]`` and ``trailer`` ``[t, hidden]`` (float32)
with ``filler_id``, ``hidden_size`` and ``model`` in its metadata (:meth:`FactWrappers.load`).

While encoding, a wrapper position is marked in the row's ids by a negative id (``-1 - slot``,
slots numbered header first); :meth:`FactWrappers.applied` makes the model's input embedding
read those slots from the trained vectors.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from inferscale.errors import ConfigError, ModelMismatchError

FORMAT = "inferscale-fact-wrappers/1"


@dataclass(frozen=True, eq=False)
class FactWrappers:
    """Header and trailer vectors (see the module docstring)."""

    header: torch.Tensor  # [h, hidden]
    trailer: torch.Tensor  # [t, hidden]
    filler_id: int
    model: str = ""
    source: str = ""

    def __post_init__(self):
        h, t = self.header, self.trailer
        if h.dim() != 2 or t.dim() != 2 or h.shape[1] != t.shape[1]:
            raise ConfigError(f"fact wrappers {self.where}: header {tuple(h.shape)} and trailer {tuple(t.shape)} "
                              f"must be [count, hidden] with the same hidden size")
        if h.shape[0] + t.shape[0] == 0:
            raise ConfigError(f"fact wrappers {self.where}: no header and no trailer vector")
        if not (bool(torch.isfinite(h).all()) and bool(torch.isfinite(t).all())):
            raise ConfigError(f"fact wrappers {self.where}: a vector holds a value that is not finite")
        if isinstance(self.filler_id, bool) or not isinstance(self.filler_id, int) or self.filler_id < 0:
            raise ConfigError(f"fact wrappers {self.where}: filler_id must be a token id >= 0, got {self.filler_id!r}")

    @property
    def where(self) -> str:
        return self.source or "(in memory)"

    @property
    def num_header(self) -> int:
        return self.header.shape[0]

    @property
    def num_trailer(self) -> int:
        return self.trailer.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.header.shape[1]

    # -- token ids

    def marked(self, ids: Sequence[int]) -> tuple[int, ...]:
        """``ids`` wrapped, each wrapper position marked by its slot (``-1 - slot``)."""
        h, t = self.num_header, self.num_trailer
        return tuple(-1 - s for s in range(h)) + tuple(ids) + tuple(-1 - h - s for s in range(t))

    def stored(self, ids: Sequence[int]) -> tuple[int, ...]:
        """Marked ids as they are stored: each wrapper position holds the filler."""
        return tuple(self.filler_id if i < 0 else i for i in ids)

    def wrapped(self, ids: Sequence[int]) -> tuple[int, ...]:
        """A fact's ids as stored with its wrappers."""
        return self.stored(self.marked(ids))

    def is_wrapped(self, ids: Sequence[int]) -> bool:
        """Whether stored ids carry these wrappers' positions (the filler, a space, never begins or
        ends a rendered fact: ``"- text\\n"``)."""
        h, t = self.num_header, self.num_trailer
        return len(ids) >= h + t and all(i == self.filler_id for i in (*ids[:h], *ids[len(ids) - t:]))

    def unwrapped(self, ids: Sequence[int]) -> tuple[int, ...]:
        """A stored fact's own ids: its wrapper positions dropped (ids stored without wrappers, as
        they were before wrappers were configured, are returned as they are)."""
        if not self.is_wrapped(ids):
            return tuple(ids)
        return tuple(ids[self.num_header: len(ids) - self.num_trailer])

    # -- the model

    def check(self, model: nn.Module) -> FactWrappers:
        """Self, if its vectors fit the model's input embedding; else :class:`ModelMismatchError`."""
        embedding = model.get_input_embeddings()
        width, vocab = embedding.weight.shape[1], embedding.weight.shape[0]
        if width != self.hidden_size or self.filler_id >= vocab:
            raise ModelMismatchError(
                f"fact wrappers {self.where} were trained for hidden size {self.hidden_size}"
                f"{f' ({self.model})' if self.model else ''}; this model has {width} (and {vocab} token ids, "
                f"filler {self.filler_id})")
        return self

    def vectors(self) -> torch.Tensor:
        """Every slot's vector, header first: ``[h + t, hidden]``."""
        return torch.cat([self.header, self.trailer])

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """While inside, the model's input embedding reads a marked position (a negative id) from
        this wrapper's vectors."""
        with embedding_slots(model, self.vectors()):
            yield

    # -- files

    def save(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        meta = {"format": FORMAT, "filler_id": str(self.filler_id), "model": self.model,
                "hidden_size": str(self.hidden_size)}
        save_file({"header": self.header.detach().float().contiguous(),
                   "trailer": self.trailer.detach().float().contiguous()}, os.fspath(path), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike) -> FactWrappers:
        """Read a wrappers file; a file that is not one raises :class:`ConfigError`."""
        from safetensors import SafetensorError, safe_open

        where = os.fspath(path)
        try:
            with safe_open(os.path.expanduser(where), framework="pt") as fh:
                meta = fh.metadata() or {}
                tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        except (OSError, SafetensorError, ValueError) as exc:
            raise ConfigError(f"fact wrappers {where}: not a readable safetensors file ({exc})") from None
        if meta.get("format") != FORMAT or set(tensors) != {"header", "trailer"}:
            raise ConfigError(f"fact wrappers {where}: expected format {FORMAT} with tensors header and trailer, "
                              f"found {meta.get('format')!r} with {sorted(tensors)}")
        try:
            filler = int(meta.get("filler_id", ""))
        except ValueError:
            raise ConfigError(f"fact wrappers {where}: filler_id {meta.get('filler_id')!r} is not an integer") from None
        return cls(tensors["header"].float(), tensors["trailer"].float(), filler, meta.get("model", ""), where)


@contextmanager
def embedding_slots(model: nn.Module, table: torch.Tensor) -> Iterator[None]:
    """While inside, an input id ``-1 - s`` embeds as ``table[s]`` (gradients reach ``table``)."""
    embedding = model.get_input_embeddings()
    seen: list[torch.Tensor] = []

    def before(module, args):
        seen.append(args[0])
        return (args[0].clamp_min(0), *args[1:])

    def after(module, args, out):
        ids = seen.pop()
        mask = ids < 0
        if not bool(mask.any()):
            return out
        out = out.clone()
        out[mask] = table.to(out.device, out.dtype)[(-1 - ids[mask]).to(out.device)]
        return out

    hooks = [embedding.register_forward_pre_hook(before), embedding.register_forward_hook(after)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
