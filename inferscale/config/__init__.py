"""InferScale's configuration: the user's settings (:class:`Config`, :mod:`.settings`), the
backends and model they name (:mod:`.specs`, names checked in :mod:`.names`), and the
connector's internal tuning (:class:`Tuning`, :mod:`.tuning`).

Backends are chosen by registered name; see :func:`build`.
"""

from inferscale.config.names import BACKEND_DEFAULTS, BUILTIN_NAMES, check_backend_names
from inferscale.config.settings import DEFAULT_CLOSING, DEFAULT_INSTRUCTION, FACT_STYLES, Config
from inferscale.config.specs import BackendSpec, ModelSpec, build, make_options
from inferscale.config.tuning import PINNED_READS, TUNING_KEYS, Tuning

__all__ = [
    "BACKEND_DEFAULTS",
    "BUILTIN_NAMES",
    "DEFAULT_CLOSING",
    "DEFAULT_INSTRUCTION",
    "FACT_STYLES",
    "PINNED_READS",
    "TUNING_KEYS",
    "BackendSpec",
    "Config",
    "ModelSpec",
    "Tuning",
    "build",
    "check_backend_names",
    "make_options",
]
