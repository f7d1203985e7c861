"""How the connector writes a step's memory into vLLM's paged cache, and when the engine has room
for an adaptive recompute tail: internal tuning, kept apart from the user's settings. The defaults
suit the GPUs InferScale is tested on; what each choice costs is measured in
benchmarks/results/README.md.

In TOML these go in a ``[tuning]`` table; the same keys at the top level are still accepted,
with a ``DeprecationWarning`` (:func:`split_flat_tuning`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inferscale.errors import ConfigError

#: Tuning.pinned_reads
PINNED_READS = ("copy", "overlap")
#: Tuning.async_loads
ASYNC_LOADS = ("auto", "always", "never")


@dataclass(frozen=True)
class Tuning:
    #: on CUDA, write a step's memory into the paged cache with one fused kernel
    #: (inject/fused_write.py) instead of whole-tensor ops and one backend write per layer
    #: (where the kernel cannot run, e.g. the CPU or an unknown cache layout, the latter is used)
    fused_write: bool = True
    #: how the fused write reads facts held in pinned host memory (kv_store "pinned"): "overlap"
    #: (the kernel reads host memory in place, a group of layers per launch on a side stream, each
    #: layer's attention waiting only for its group, where the GPU has nothing queued; a step
    #: issued while it still runs earlier ones is copied as "copy" does) or "copy" (one DMA per run
    #: of facts back to back in host memory on a copy stream that waits for nothing, then the
    #: kernel, before the forward pass)
    pinned_reads: str = "overlap"
    #: with pinned_reads = "overlap": at most this many programs of the kernel per layer, each
    #: writing every n-th token (0: one program per token). Reads of host memory wait on the bus;
    #: fewer programs hold fewer of the SMs the forward pass beside them needs
    pinned_read_programs: int = 16
    #: with pinned_reads = "overlap": launches the read is split into, a group of consecutive
    #: layers each; layer 0's attention waits for the first group only, so more groups start the
    #: forward sooner, each launch costing host time
    pinned_read_launches: int = 8
    #: replay the fused write from CUDA graphs captured once per table capacity
    #: (inject/write_graphs.py): a step's write costs one graph launch instead of Triton's
    #: launcher and a table copy; false launches the kernel every step
    write_graphs: bool = True
    #: with write_graphs and pinned_reads = "overlap": the groups' launches of an in-place read
    #: replayed from one CUDA graph per step (each group's event recorded by the graph), instead
    #: of a Triton launch and an event per group (inject/write_graphs.py); false launches each group
    pinned_read_graphs: bool = True
    #: with pinned_reads = "overlap": a step that loads fewer MiB than this copies them to the GPU
    #: first, as "copy" does (a DMA per run of facts, then the write on the forward stream), since an
    #: in-place read costs about the same fixed host time (its launch, the forward's waits) at any
    #: size; 0 reads every step in place
    pinned_copy_below_mib: float = 96.0
    #: with pinned_reads = "overlap": a step that loads more MiB than this reads them in place even
    #: while the GPU still runs earlier steps (where it would otherwise copy them, beside those
    #: steps): a copy takes a GPU buffer of that size outside the memory vLLM sizes its cache from;
    #: 0 reads every step from pinned_copy_below_mib on in place, busy GPU or not. Loads beside the
    #: batch (async_loads) always copy: a step issues at most this many MiB of them (and at least one
    #: load), the rest the next step
    pinned_copy_above_mib: float = 1024.0
    #: when a request's memory is loaded (inject/load_mode.py): "always" in the background (the
    #: request waits in vLLM's WAITING_FOR_REMOTE_KVS while the batch runs; the K/V is copied on a
    #: stream of its own and the request joins the batch once it has arrived), "never" before the
    #: forward pass of the step that prefills the request (that step waits for its requests'
    #: reads), or "auto": in the background on a GPU where the memory tier (kv_store) is not "hbm",
    #: unless the request would run alone in its step (then before the forward pass). "auto" by
    #: measurement: pinned, 100 users on one H100, 1.21x "never"'s requests/s in one run
    #: (benchmarks/results/load_side_1207f_pinned_never_pinned_auto_h100.md)
    async_loads: str = "auto"
    #: with async_loads = "auto" where it loads beside the batch: the memory tokens a step may still
    #: load before its forward pass (in vLLM's order of admission); a request whose load would take
    #: the step past them loads beside the batch instead. Copies issued while the GPU still runs
    #: the step before cost the batch little; a burst of them holds up every request in the step.
    #: 0: every request loads beside the batch unless it would run alone (inject/load_mode.py)
    before_forward_tokens: int = 0
    #: loads beside the batch: users their memory tier does not hold are read from the store of
    #: record on this many threads at once (a read is mostly checksum, file and copy work, which
    #: release Python's lock; benchmarks/user_reads.py measures users/s against threads)
    user_read_threads: int = 4
    #: with recompute_tokens = "adaptive": a request's tail is left to vLLM only while the step
    #: being scheduled holds at most this many tokens of other requests: one for each request
    #: decoding, those of each request admitted before it in the step (a tail included). A lone
    #: request's tail costs little; under load every token of a step costs the GPU its full price
    #: and delays every request decoding beside it (docs/connector.md)
    tail_max_step_tokens: int = 64
    #: with recompute_tokens = "adaptive": ... and at most this many other requests are waiting
    #: to be admitted (a queue means the engine has no room to spare)
    tail_max_waiting: int = 0

    def __post_init__(self):
        for name in ("fused_write", "write_graphs", "pinned_read_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"tuning {name} must be true or false, got {getattr(self, name)!r}")
        for name, least in (("pinned_read_programs", 0), ("pinned_read_launches", 1), ("tail_max_step_tokens", 0),
                            ("tail_max_waiting", 0), ("user_read_threads", 1), ("before_forward_tokens", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"tuning {name} must be an integer ≥ {least}, got {value!r}")
        for name in ("pinned_copy_below_mib", "pinned_copy_above_mib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"tuning {name} must be a number ≥ 0, got {value!r}")
        for name, allowed in (("pinned_reads", PINNED_READS), ("async_loads", ASYNC_LOADS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"tuning {name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

    @classmethod
    def parse(cls, value: Any) -> Tuning:
        """A :class:`Tuning` or a ``[tuning]`` table."""
        if isinstance(value, Tuning):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"[tuning] must be a table, got {value!r}")
        unknown = set(value) - TUNING_KEYS
        if unknown:
            raise ConfigError(f"[tuning] unknown key(s) {sorted(unknown)} — known: {sorted(TUNING_KEYS)}")
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


TUNING_KEYS = frozenset(f.name for f in dataclasses.fields(Tuning))


def split_flat_tuning(data: Mapping[str, Any], where: str, stacklevel: int,
                      instead: str = "under [tuning]") -> dict[str, Any]:
    """``data`` (a config's top-level keys) with the tuning keys given there, as configs did
    before ``[tuning]``, moved into its ``tuning`` entry, with a DeprecationWarning naming them
    (``where``, then the keys, then what to do ``instead``). A key given both ways is refused."""
    flat = {key: data[key] for key in data if key in TUNING_KEYS}
    if not flat:
        return dict(data)
    warnings.warn(f"{where} {', '.join(sorted(flat))}: deprecated, "
                  f"set {'it' if len(flat) == 1 else 'them'} {instead}",
                  DeprecationWarning, stacklevel=stacklevel + 1)
    rest = {key: value for key, value in data.items() if key not in flat}
    tuning = rest.get("tuning", Tuning())
    if isinstance(tuning, Mapping):
        twice = set(tuning) & set(flat)
        if twice:
            raise ConfigError(f"{sorted(twice)} given both at the top level and under [tuning]")
        rest["tuning"] = {**tuning, **flat}
    else:
        rest["tuning"] = dataclasses.replace(Tuning.parse(tuning), **flat)
    return rest
