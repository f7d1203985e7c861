"""The share of the machine's memory a host-memory tier takes by default (``max_bytes = "auto"``).

A quarter of the machine's memory (or of its container's limit), split between its GPUs: each
GPU's engine holds a tier of its own in the same memory, and the rest stays for the engine, the page
cache of the store of record and whatever else the machine runs. Read once where a tier is built.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from inferscale.storage.resident.store import DEFAULT_MAX_BYTES

#: where a container's memory limit is read: cgroup v2's file, then cgroup v1's
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
#: a cgroup limit this large means none (cgroup v1 writes "no limit" as about 2**63)
_NO_LIMIT = 1 << 60


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
