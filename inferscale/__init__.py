"""InferScale: users' facts as reusable, position-independent KV for vLLM.

Importing this package imports neither vLLM nor any backend; plugins load on
first use.
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
