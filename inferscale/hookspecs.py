"""Hook specifications: how a plugin adds backends to InferScale.

A plugin is a module (or object) with functions marked ``@inferscale.hookimpl``
whose names match the specs below. Each hook receives a ``register`` callable;
call it once per backend class. A backend class has a unique ``name`` class
attribute, which is what a config uses to select it. Built-in backends are
registered through these same hooks.

Third-party plugins are found through the ``inferscale`` entry-point group::

    [project.entry-points.inferscale]
    my_plugin = "my_package.plugin"
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("inferscale")
hookimpl = pluggy.HookimplMarker("inferscale")


@hookspec
def register_retrievers(register):
    """Register :class:`inferscale.retrieval.Retriever` subclasses (top-k fact search)."""


@hookspec
def register_kv_stores(register):
    """Register :class:`inferscale.storage.KVStore` subclasses (where facts' K/V live). One
    meant as the worker's memory tier (``Config.kv_store``) also fulfils
    :class:`inferscale.storage.tiers.memory.MemoryTier` (checked when the tiers are built;
    ``plugins/inferscale-mmap`` is an example)."""


@hookspec
def register_windows(register):
    """Register :class:`inferscale.encode.WindowPolicy` subclasses: what a fact is
    encoded behind (the facts stored before it, or the conversation before it)."""


@hookspec
def register_composers(register):
    """Register :class:`inferscale.compose.base.Composer` subclasses: how retrieved facts
    are ordered into the memory segment."""


@hookspec
def register_embedders(register):
    """Register :class:`inferscale.retrieval.Embedder` subclasses (text → vector)."""
