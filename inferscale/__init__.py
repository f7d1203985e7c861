"""InferScale: users' facts as reusable, position-independent KV for vLLM.

Importing this package imports neither vLLM nor any backend; plugins load on
first use. The map (README's "Layout" has it file by file): the ground floor every part may
use (``errors``, ``facts``, ``kv``, ``kv_fp8``, ``files``, ``devices``, ``threads``, ``secret``,
``session``, ``host_memory``; the plugin manager ``plugins`` and ``hookspecs``), then ``config/``;
``encode/`` (facts → pre-RoPE K/V), ``storage/`` (where K/V live), ``retrieval/`` (which facts),
``compose/`` (the segment, chunked RoPE, salts); ``inject/`` (the vLLM-free write path) under
``connector/`` (the vLLM adapter); ``api/`` (the facade) with ``mem0/`` behind it; ``server/`` and
``cli/`` on top; ``datasets/`` and ``client.py`` beside. No import runs in a ring, between modules or
folders (tests/test_layering.py).
"""

from inferscale.config import BackendSpec, Config, ModelSpec, build
from inferscale.errors import (
    CapacityError,
    ConfigError,
    CorruptDataError,
    InferScaleError,
    MissingFactError,
    ModelMismatchError,
    PluginError,
    UnknownBackendError,
    UnknownUserError,
)
from inferscale.facts import Fact, make_fact_id
from inferscale.hookspecs import hookimpl
from inferscale.kv import FactKV, KVBatch

__all__ = [
    "BackendSpec",
    "CapacityError",
    "Config",
    "ConfigError",
    "CorruptDataError",
    "Fact",
    "FactKV",
    "InferScaleError",
    "KVBatch",
    "MissingFactError",
    "ModelMismatchError",
    "ModelSpec",
    "PluginError",
    "UnknownBackendError",
    "UnknownUserError",
    "build",
    "hookimpl",
    "make_fact_id",
]
__version__ = "0.1.0"
