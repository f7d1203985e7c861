"""One user's vectors as the rows of a matrix, with ``fact_id`` ↔ row maps."""

from __future__ import annotations

import torch


class UserMatrix:
    """Rows of float32 vectors on one device; row ``i`` belongs to ``fact_ids[i]``.

    Appends grow a buffer by doubling (amortised O(1) per row); replacing an id
    overwrites its row in place; removal compacts the rows, keeping their order.
    """

    def __init__(self, dim: int, device: torch.device):
        self._buf = torch.empty(0, dim, dtype=torch.float32, device=device)
        self.fact_ids: list[str] = []
        self.rows: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.fact_ids)

    @property
    def vectors(self) -> torch.Tensor:
        """``[len(self), dim]`` view of the live rows."""
        return self._buf[: len(self.fact_ids)]

    def upsert(self, fact_ids: list[str], x: torch.Tensor) -> None:
        """Store ``x[i]`` under ``fact_ids[i]`` (ids unique within the call)."""
        x = x.to(device=self._buf.device, dtype=torch.float32)
        old = [(i, self.rows[f]) for i, f in enumerate(fact_ids) if f in self.rows]
        if old:
            src, dst = zip(*old)
            self._buf[list(dst)] = x[list(src)]
        new = [i for i, f in enumerate(fact_ids) if f not in self.rows]
        if new:
            self._append([fact_ids[i] for i in new], x[new])

    def remove(self, fact_ids: list[str]) -> None:
        """Drop the rows of ``fact_ids`` that are present; others are ignored."""
        drop = {self.rows[f] for f in fact_ids if f in self.rows}
        if not drop:
            return
        keep = [r for r in range(len(self)) if r not in drop]
        self._buf = self._buf[torch.tensor(keep, dtype=torch.long, device=self._buf.device)]
        self.fact_ids = [self.fact_ids[r] for r in keep]
        self.rows = {f: i for i, f in enumerate(self.fact_ids)}

    def _append(self, fact_ids: list[str], x: torch.Tensor) -> None:
        n, need = len(self), len(self) + len(fact_ids)
        if need > self._buf.shape[0]:
            grown = self._buf.new_empty(max(need, 2 * self._buf.shape[0], 16), self._buf.shape[1])
            grown[:n] = self._buf[:n]
            self._buf = grown
        self._buf[n:need] = x
        self.rows.update((f, n + i) for i, f in enumerate(fact_ids))
        self.fact_ids.extend(fact_ids)
