"""PinnedHostStore: facts' K/V in (pinned) host memory, packed per user.

Layout: each user's facts live in ONE host buffer, pinned when CUDA exists,
holding every fact's block ``[2, L, T_f, H, D]`` back to back; a fact is a
contiguous slice of it (a view). Facts kept in fp8 (``Config.kv_dtype_at_rest``) have e4m3
blocks there, and their dequant (offsets and scales, :mod:`inferscale.kv_fp8`) in one buffer
in GPU memory (:meth:`PinnedHostStore._place_dequant`). ``put``/``delete`` re-pack the user into a
new buffer; a ``get`` in flight keeps reading the old one, which stays alive
until its copies finish (torch's pinned allocator records them).

``get`` onto a GPU issues one asynchronous DMA per requested fact, straight
from the packed buffer into device memory (each a contiguous run of
``T_f x 128 KiB`` for Llama-3-8B), then joins them with one ``cat`` on the
device. Nothing is gathered on the CPU: measured on an H200 (k=50, 328 MB),
gathering the requested tokens into a pinned staging buffer with one
``index_select`` and copying once ran at 8.5x the raw PCIe copy time (the CPU
gather alone ran at about 7.5 GB/s); per-fact DMAs ran at 1.1x, the Python
loop that issues them overlapping the transfers.

**Stream ordering:** the returned tensors are produced on the current CUDA
stream; they are valid for work queued on that stream. Another stream must
``wait_stream`` (or ``torch.cuda.current_stream().synchronize()``) first.

**Budget.** By default (``max_bytes = "auto"``) the tier may hold a quarter of the machine's
memory, split between its GPUs (:func:`host_share`: 32 GiB on a machine of 128 GiB and one
GPU, 64 GiB for each of eight GPUs on a machine of 2 TiB). Buffers are allocated user by user
as users are loaded, so a large budget costs no memory until users fill it. The budget counts
what those buffers take (:func:`pinned_footprint`: page-locked buffers come in powers of two), so it
bounds the page-locked memory, not only the K/V in it.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from inferscale.storage.layout import KVLayout
from inferscale.storage.resident.store import AUTO, DEFAULT_MAX_BYTES, ResidentStore, Source

logger = logging.getLogger(__name__)

#: where a container's memory limit is read: cgroup v2's file, then cgroup v1's
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
#: a cgroup limit this large means none (cgroup v1 writes "no limit" as about 2**63)
_NO_LIMIT = 1 << 60


class PinnedHostStore(ResidentStore):
    """Host-memory K/V store; ``get`` moves the requested facts to the GPU asynchronously.

    Without CUDA the buffers are ordinary memory and ``get`` returns CPU tensors.
    """

    name: ClassVar[str] = "pinned"

    def __init__(self, options: ResidentStore.Options | None = None, **runtime: Any):
        super().__init__(options, **runtime)
        #: True when the host buffers are page-locked (CUDA is available)
        self.pinned = torch.cuda.is_available()
        if (options or self.Options()).max_bytes == AUTO:
            logger.info("inferscale: %s", budget_line(self.name, self.max_bytes, machine_memory(), machine_gpus()))

    @classmethod
    def auto_max_bytes(cls) -> int:
        """The budget ``max_bytes = "auto"`` stands for: this machine's :func:`host_share`, read
        when the store is built. Pinned buffers are allocated per user as users are loaded, so
        the budget is a ceiling, not memory taken up front."""
        return host_share(machine_memory(), machine_gpus())

    def _footprint(self, nbytes: int) -> int:
        """Page-locked, a user's buffer takes :func:`pinned_footprint` of its K/V: the budget bounds
        the page-locked memory the tier holds, not only the K/V in it."""
        return pinned_footprint(nbytes) if self.pinned else nbytes

    def _place(self, layout: KVLayout, sources: Mapping[str, Source]) -> dict[str, torch.Tensor]:
        """Pack every fact of ``sources`` into one new host buffer; return views into it."""
        lengths = {fact_id: _num_tokens(src) for fact_id, src in sources.items()}
        step = layout.token_numel()
        total = sum(lengths.values()) * step
        packed = self._buffer(total, layout.stored_dtype)
        blocks, start = {}, 0
        for fact_id, src in sources.items():
            stop = start + lengths[fact_id] * step
            block = packed[start:stop].view(layout.block_shape(lengths[fact_id]))
            _fill(block, src)
            blocks[fact_id] = block
            start = stop
        return blocks

    def _place_dequant(self, dequant: Mapping[str, torch.Tensor], blocks: Mapping[str, torch.Tensor]
                       ) -> dict[str, torch.Tensor]:
        """fp8 facts' dequant packed into one buffer in GPU memory where there is one (the host's
        otherwise): the fused write reads a fact's dequant for each of its tokens, which from host
        memory would cross the bus again every time; in GPU memory it costs ~3-6 % of the user's
        bytes there (:meth:`~inferscale.storage.layout.KVLayout.fact_nbytes`)."""
        where = self.device if self.device.type == "cuda" else torch.device("cpu")
        packed = torch.cat([d.reshape(-1) for d in dequant.values()]).to(where)
        parts = packed.split([d.numel() for d in dequant.values()])
        return {fact_id: part.view(d.shape) for (fact_id, d), part in zip(dequant.items(), parts)}

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new host buffer of ``numel`` elements for one user's packed facts (page-locked
        where CUDA exists)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.pinned and numel > 0)


def pinned_footprint(nbytes: int) -> int:
    """The page-locked memory a buffer of ``nbytes`` takes: torch's pinned allocator rounds every
    allocation up to a power of two (and keeps freed blocks for reuse at that size), so a user of
    38 MB of K/V holds 64 MiB."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def host_share(memory_bytes: int, gpus: int) -> int:
    """The pinned tier's budget on a machine of ``memory_bytes`` of memory and ``gpus`` GPUs: a
    quarter of the memory, split evenly between the GPUs (each GPU's engine holds its own tier
    in the same memory), but never less than :data:`DEFAULT_MAX_BYTES` where a quarter of the
    memory allows it. One GPU and 128 GiB: 32 GiB; 8 GPUs and 2 TiB: 64 GiB each; 24 GiB and no
    GPU: 6 GiB; an 8 GiB laptop: 2 GiB. ``gpus`` below 1 counts as 1.

    The rest stays for the engine (the model's weights pass through host memory as they load),
    the page cache of the store of record and whatever else the machine runs. The budget is a
    ceiling: each user's buffer is allocated (and page-locked) when the user is loaded, so
    memory the tier's users do not fill is never taken."""
    if memory_bytes < 0:
        raise ValueError(f"memory_bytes must be >= 0, got {memory_bytes!r}")
    quarter = memory_bytes // 4
    return max(quarter // max(gpus, 1), min(DEFAULT_MAX_BYTES, quarter))


def machine_memory(cgroup_files: Iterable[str | os.PathLike] = CGROUP_MEMORY_LIMITS) -> int:
    """Bytes of memory this process may use: the physical memory, lowered to the memory limit
    of the cgroup (the container) it runs in where one is set (``cgroup_files``, each read with
    :func:`cgroup_memory_limit`). Where the system does not tell its physical memory, 16 GiB,
    whose share is :data:`DEFAULT_MAX_BYTES`."""
    limits = [limit for limit in map(cgroup_memory_limit, cgroup_files) if limit is not None]
    return min([_physical_memory(), *limits])


def cgroup_memory_limit(path: str | os.PathLike) -> int | None:
    """The memory limit in one cgroup file (cgroup v2's ``memory.max``: a number or ``max``;
    cgroup v1's ``memory.limit_in_bytes``: a number, huge when there is no limit); None for no
    limit, also where the file is missing or unreadable."""
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text.isdigit():
        return None
    limit = int(text)
    return limit if limit < _NO_LIMIT else None


@functools.cache
def machine_gpus() -> int:
    """GPUs in this machine, all of them and not only those this process sees (each GPU's
    engine holds its own pinned tier in the machine's memory): NVML's count where
    ``pynvml`` (the ``nvidia-ml-py`` package, installed with vLLM) loads, else the CUDA devices
    torch sees; at least 1. Read once per process."""
    return max(_nvml_gpus() or torch.cuda.device_count(), 1)


def budget_line(name: str, budget: int, memory_bytes: int, gpus: int) -> str:
    """The log line that says how a tier's budget follows from the machine: ``pinned tier budget
    32.0 GiB (a quarter of 128.0 GiB of memory, 1 GPU)``."""
    per_gpu = memory_bytes // 4 // max(gpus, 1)
    quarter = f"a quarter of {_gib(memory_bytes)} of memory"
    split = f"{quarter}, 1 GPU" if gpus <= 1 else f"{quarter} split between {gpus} GPUs"
    if budget == per_gpu:
        return f"{name} tier budget {_gib(budget)} ({split})"
    return f"{name} tier budget {_gib(budget)} (the least a tier gets; {split} is {_gib(per_gpu)})"


def _nvml_gpus() -> int | None:
    """NVML's count of the machine's GPUs; None where ``pynvml`` or the driver is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        return pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 4 * DEFAULT_MAX_BYTES


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _num_tokens(src: Source) -> int:
    return src.shape[2] if isinstance(src, torch.Tensor) else src.num_tokens


def _fill(block: torch.Tensor, src: Source) -> None:
    """Copy a held block or a new fact (possibly on a GPU) into ``block``."""
    if isinstance(src, torch.Tensor):
        block.copy_(src)
    else:
        block[0].copy_(src.keys)
        block[1].copy_(src.values)
