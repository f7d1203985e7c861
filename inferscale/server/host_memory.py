"""Host memory of `inferscale serve`: the allocator and cache settings that keep it flat, in one place.

Measured on the 10-minute load run (benchmarks/serve_load.py, CPU, 100 users, memory writes mixed
in), the front and vLLM's worker process grew for as long as they served, +150 MB/min together,
for two reasons:

- **glibc malloc keeps what Python and torch free.** Once a large block is freed, glibc raises its
  mmap threshold (up to 32 MiB), so the tensors of a few hundred KiB to a few MiB that every request
  and every memory write allocates and frees (query and encoder activations, facts' K/V read,
  gathered and rotated) come from the heaps, where a block that lives on (a user's K/V in the
  memory tier, an index entry) keeps the free space around it from going back to the system; and
  each thread that allocates gets an arena of its own (up to 8 per core: the front's request
  threads, torch's threads), each keeping its own free space. Calling ``malloc_trim(0)`` in the
  running processes returned 350 MB of the front and 425 MB of the worker after 4 minutes.
  Settings: ``MALLOC_MMAP_THRESHOLD_`` = 256 KiB, fixed (a block that size or larger is mapped on
  its own and unmapped when freed; a fixed value also stops glibc raising it), and
  ``MALLOC_ARENA_MAX=2``.
- **oneDNN caches a primitive per matrix shape** (vLLM on a CPU runs its linear layers through
  oneDNN; the token count of each step is a new shape), each with a 264 KiB descriptor and JIT code,
  up to 1,024 of them by default: the worker grew by ~40 MB/min for the ten minutes that cache took
  to fill. vLLM keeps its own 32 per layer shape on top, so the global cache only saves re-creating
  a shape vLLM dropped. Setting: ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (CPU engines).

`inferscale serve` applies the malloc settings to itself at start (``mallopt``, before its
threads exist) and passes all of them to the engine in its environment, so vLLM's processes start
with them. A variable already set in the environment is left as it is (yours wins), and is not
applied to the front either: glibc has read it at the front's start. Nothing here applies where
the C library is not glibc, or under a preloaded allocator (tcmalloc, jemalloc), which ignores them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Mapping

logger = logging.getLogger(__name__)

#: glibc malloc settings for the front and the engine (environment variable → value)
MALLOC_SETTINGS = {"MALLOC_ARENA_MAX": "2", "MALLOC_MMAP_THRESHOLD_": str(256 << 10)}
#: glibc's ``mallopt`` parameters for those variables (malloc.h: M_ARENA_MAX, M_MMAP_THRESHOLD)
MALLOPT_PARAMS = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_THRESHOLD_": -3}
#: oneDNN's primitive cache for an engine on a CPU (its default: 1,024 primitives)
CPU_ENGINE_SETTINGS = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "256"}


def engine_environment(environ: Mapping[str, str], device_type: str) -> dict[str, str]:
    """``environ`` with the settings added where it does not set them already."""
    settings = {**MALLOC_SETTINGS, **(CPU_ENGINE_SETTINGS if device_type == "cpu" else {})}
    return {**settings, **environ}


def configure_this_process(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Apply the malloc settings that ``environ`` does not set to this process (glibc only);
    the settings applied."""
    mallopt = _mallopt()
    if mallopt is None:
        return {}
    applied = {}
    for name, value in MALLOC_SETTINGS.items():
        if name in environ:
            continue
        if mallopt(MALLOPT_PARAMS[name], int(value)) == 1:
            applied[name] = value
        else:
            logger.warning("mallopt(%s=%s) failed; host memory may grow while serving", name, value)
    return applied


def _mallopt():
    """glibc's ``mallopt``, or None under another C library."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has no such symbol)
        mallopt = libc.mallopt
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return mallopt
    return None
