"""Backend names checked when a config loads, before any engine starts.

A name a built-in plugin registers is accepted without importing anything (the
built-in backends import torch); any other name loads the plugins
(:mod:`inferscale.plugins`: the built-in ones and the ``inferscale`` entry points)
and must be registered by one of them.
"""

from __future__ import annotations

from collections.abc import Mapping

from inferscale.errors import UnknownBackendError

#: the config's backend sections (also :data:`inferscale.plugins.KINDS`) and their defaults
BACKEND_DEFAULTS = {
    "retriever": "exact",
    "kv_store": "pinned",
    "window": "facts",
    "composer": "relevance",
    "embedder": "minilm",
}

#: the names the built-in plugins always register (tests/test_config_names.py keeps this in step
#: with them); "jasper" and "cagra" are left out, as they are registered only where they can be imported
BUILTIN_NAMES: Mapping[str, frozenset[str]] = {
    "retriever": frozenset({"exact", "faiss"}),
    "kv_store": frozenset({"hbm", "pinned", "disk", "redis"}),
    "window": frozenset({"facts", "neighbours", "turns", "tokens", "none"}),
    "composer": frozenset({"relevance"}),
    "embedder": frozenset({"minilm", "openai"}),
}


def check_backend_names(names: Mapping[str, str]) -> None:
    """Raise :class:`~inferscale.errors.UnknownBackendError` (a ``ConfigError``) listing the
    registered names, for the first of ``names`` (kind → backend name) no plugin registers."""
    unusual = {kind: name for kind, name in names.items() if name not in BUILTIN_NAMES[kind]}
    if not unusual:
        return
    from inferscale.plugins import backends

    for kind, name in unusual.items():
        known = backends(kind)
        if name not in known:
            raise UnknownBackendError(kind, name, known)
