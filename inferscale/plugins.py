"""The plugin manager: built-in backends and entry-point plugins, loaded lazily.

Nothing is imported at ``import inferscale`` time. The first call to
:func:`backends` (or :func:`get_backend`) registers the built-in plugins and
every plugin found in the ``inferscale`` entry-point group.

``INFERSCALE_PLUGINS`` restricts entry-point loading, for debugging: a comma
separated allow-list of entry-point names (empty string: load none).
"""

from __future__ import annotations

import importlib
import os
import threading
from importlib.metadata import entry_points

import pluggy

from inferscale import hookspecs
from inferscale.errors import PluginError, UnknownBackendError

ENTRY_POINT_GROUP = "inferscale"

DEFAULT_PLUGINS = (
    "inferscale.retrieval.plugin",
    "inferscale.storage.plugin",
    "inferscale.encode.plugin",
    "inferscale.compose.plugin",
)

#: backend kind → the hook that registers it
KINDS = {
    "retriever": "register_retrievers",
    "kv_store": "register_kv_stores",
    "window": "register_windows",
    "composer": "register_composers",
    "embedder": "register_embedders",
}

pm = pluggy.PluginManager("inferscale")
pm.add_hookspecs(hookspecs)

_lock = threading.Lock()
_loaded = False


def load_plugins() -> None:
    """Register the built-in and entry-point plugins once (idempotent, thread-safe)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        for module_name in DEFAULT_PLUGINS:
            module = importlib.import_module(module_name)
            if not pm.is_registered(module):
                pm.register(module, name=module_name)
        _load_entry_points()
        pm.check_pending()
        _loaded = True


def _load_entry_points() -> None:
    allow = os.environ.get("INFERSCALE_PLUGINS")
    allowed = None if allow is None else {n.strip() for n in allow.split(",") if n.strip()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and ep.name not in allowed:
            continue
        if pm.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken third-party plugin must say who it is
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
        pm.register(plugin, name=ep.name)


def backends(kind: str) -> dict[str, type]:
    """All registered backend classes of one kind, by name."""
    if kind not in KINDS:
        raise UnknownBackendError("backend kind", kind, KINDS)
    load_plugins()
    found: dict[str, type] = {}

    def register(cls: type) -> None:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"{kind} backend {cls!r} has no string 'name' attribute")
        if name in found and found[name] is not cls:
            raise PluginError(f"{kind} {name!r} registered twice: {found[name]!r} and {cls!r}")
        found[name] = cls

    getattr(pm.hook, KINDS[kind])(register=register)
    return found


def get_backend(kind: str, name: str) -> type:
    """The backend class registered under ``name``; a clear error lists the known ones."""
    known = backends(kind)
    try:
        return known[name]
    except KeyError:
        raise UnknownBackendError(kind, name, known) from None
