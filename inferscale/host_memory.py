"""Host memory of `inferscale serve`: the allocator and cache settings that keep it flat, in one place.

Measured on the load run (benchmarks/serve_load.py, CPU, 100 users chatting, memory writes mixed
in), the front and vLLM's worker process grew for as long as they served, for two reasons:

- **glibc malloc keeps what torch and Python free.** Once a large block is freed, glibc raises its
  mmap threshold (up to 32 MiB), so the tensors of a few hundred KiB to a few MiB that every step,
  request and memory write allocates and frees (activations, facts' K/V read, gathered and rotated)
  come from the heaps, where blocks that live on (a user's K/V in the memory tier, a cached kernel)
  keep the free space between them from going back to the system: glibc returns memory only from a
  heap's top. And each thread that allocates gets an arena of its own (up to 8 per core: the front's
  request threads, torch's threads), each with its own free space. After 4 minutes of load,
  ``malloc_trim(0)`` called in the running processes returned 350 MB of the front and 425 MB of the
  worker.
- **oneDNN caches a primitive per matrix shape.** vLLM on a CPU runs its linear layers through
  oneDNN, and a step's token count is a new shape: each primitive holds a 264 KiB descriptor and
  JIT code, up to 1,024 primitives by default, so the worker grew ~30 MB/min until that cache
  filled (gdb on ``mmap``: ``dnnl_matmul_primitive_desc_create``). vLLM keeps its own 32 per layer
  shape on top, so the global cache only saves re-creating a shape vLLM dropped.

Settings, each where it costs least:

- **the front**: ``MALLOC_ARENA_MAX=2`` and a fixed 256 KiB ``MALLOC_MMAP_THRESHOLD_`` (a block that
  size or larger is mapped on its own and unmapped when freed; a fixed value also stops glibc
  raising it), applied with ``mallopt`` at start. Its work per chat is small (a query embedding, a
  prompt layout); memory writes pay for it, the encoder's activations being mapped afresh (write
  latency p50 1.9 s before, 2.7-3.4 s in the load runs with it, on a shared machine).
- **the engine** (its environment): ``MALLOC_ARENA_MAX=2``; ``INFERSCALE_MALLOC_TRIM_S=10``, on which
  the connector's worker side calls ``malloc_trim(0)`` every 10 s, handing the free pages inside the
  heaps back; and on a CPU ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=256``. Not the fixed mmap threshold:
  every step allocates megabytes of activations, and mapping them afresh faults their pages in each
  time (a loop of 1.9 MB matmuls ran 1.3-1.6x slower with it).

A variable already set in the environment is left as it is (yours wins; ``INFERSCALE_MALLOC_TRIM_S=0``
turns the worker's trimming off). Nothing here applies where the C library is not glibc, or under a
preloaded allocator (tcmalloc, jemalloc), which ignores the ``MALLOC_*`` variables.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Mapping

logger = logging.getLogger(__name__)

#: glibc malloc settings for the front (environment variable → value)
FRONT_SETTINGS = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(256 << 10)}
#: glibc's ``mallopt`` parameter for each of them (malloc.h: M_ARENA_MAX, M_MMAP_THRESHOLD)
MALLOPT_PARAMS = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_THRESHOLD_": -3}
#: glibc malloc settings for the engine
ENGINE_SETTINGS = {"MALLOC_ARENA_MAX": "2"}
#: seconds between two ``malloc_trim(0)`` in vLLM's worker (0: never)
TRIM_ENV = "INFERSCALE_MALLOC_TRIM_S"
DEFAULT_TRIM_S = 10.0
#: oneDNN's primitive cache for an engine on a CPU (its default: 1,024 primitives)
CPU_ENGINE_SETTINGS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}

_trimming: threading.Thread | None = None
_stop_trimming = threading.Event()
_trimming_lock = threading.Lock()


def engine_environment(environ: Mapping[str, str], device_type: str) -> dict[str, str]:
    """``environ`` with the settings added where it does not set them already."""
    settings = {**ENGINE_SETTINGS, TRIM_ENV: f"{DEFAULT_TRIM_S:g}",
                **(CPU_ENGINE_SETTINGS if device_type == "cpu" else {})}
    return {**settings, **environ}


def configure_front(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Apply the front's malloc settings that ``environ`` does not set (glibc read those itself
    when the process started) to this process; the settings applied (none but under glibc)."""
    libc = _glibc()
    if libc is None:
        return {}
    applied = {}
    for name, value in FRONT_SETTINGS.items():
        if name in environ:
            continue
        if libc.mallopt(MALLOPT_PARAMS[name], int(value)) == 1:
            applied[name] = value
        else:
            logger.warning("mallopt(%s=%s) failed; host memory may grow while serving", name, value)
    return applied


def trim_interval(environ: Mapping[str, str] = os.environ, default: float = 0.0) -> float:
    """Seconds between trims that ``environ`` asks for (``default`` when it names none)."""
    value = environ.get(TRIM_ENV)
    if value is None:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        logger.warning("%s=%r is not a number of seconds; not trimming", TRIM_ENV, value)
        return 0.0


def start_trimming(interval_s: float) -> bool:
    """Call ``malloc_trim(0)`` every ``interval_s`` seconds in a daemon thread, once per process;
    True if this process trims (now or already)."""
    global _trimming
    libc = _glibc()
    if libc is None or interval_s <= 0:
        return False
    with _trimming_lock:
        if _trimming is None or not _trimming.is_alive():
            _stop_trimming.clear()
            _trimming = threading.Thread(target=_trim_every, args=(libc, interval_s), daemon=True,
                                         name="inferscale-malloc-trim")
            _trimming.start()
    return True


def stop_trimming() -> None:
    """Stop the trimming thread (a server trims until it exits; tests stop it)."""
    with _trimming_lock:
        _stop_trimming.set()
        if _trimming is not None:
            _trimming.join()


def _trim_every(libc, interval_s: float) -> None:
    while not _stop_trimming.wait(interval_s):
        libc.malloc_trim(0)


def _glibc():
    """The C library with ``mallopt`` and ``malloc_trim`` typed, or None unless it is glibc."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has no such symbol)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        return libc
    return None
