import importlib
import types

import pytest

from inferscale import BackendSpec, Config, ConfigError, PluginError, UnknownBackendError, build, hookimpl, hookspecs
from inferscale.plugins import KINDS, backends, get_backend, pm
from inferscale.retrieval.base import Hit
from plugins import reverse_alpha_composer


@pytest.fixture
def registered():
    """Register plugins for one test; always unregister them."""
    added = []

    def add(plugin, name):
        pm.register(plugin, name=name)
        added.append(plugin)

    try:
        yield add
    finally:
        for plugin in added:
            pm.unregister(plugin)


BUILTINS = {
    "retriever": {"exact", "faiss"},
    "kv_store": {"hbm", "pinned", "disk"},
    "window": {"facts", "turns", "tokens", "none"},
    "composer": {"relevance"},
    "embedder": {"minilm", "openai"},
}


@pytest.mark.parametrize("kind", sorted(BUILTINS))
def test_builtins_are_registered_through_the_hooks(kind):
    assert BUILTINS[kind] <= set(backends(kind))


def test_every_hook_is_documented_and_has_a_kind():
    specs = [n for n in dir(hookspecs) if n.startswith("register_")]
    assert sorted(specs) == sorted(KINDS.values())
    for name in specs:
        assert len(getattr(hookspecs, name).__doc__ or "") > 40, name


def test_unknown_backend_lists_known_ones():
    with pytest.raises(UnknownBackendError) as err:
        get_backend("retriever", "jaspr")
    assert "jaspr" in str(err.value) and "exact" in str(err.value) and "faiss" in str(err.value)


def test_unknown_kind():
    with pytest.raises(UnknownBackendError, match="backend kind"):
        backends("tokenizer")


def test_a_plugin_registered_at_run_time_is_selectable(registered):
    registered(reverse_alpha_composer, "reverse_alpha")
    composer = build("composer", BackendSpec("reverse-alpha"))
    assert composer.order([Hit("a", 1.0), Hit("c", 0.5), Hit("b", 0.1)]) == ["c", "b", "a"]


def test_backend_without_name_is_rejected(registered):
    plugin = types.SimpleNamespace()

    @hookimpl
    def register_composers(register):
        register(reverse_alpha_composer.Nameless)

    plugin.register_composers = register_composers
    registered(plugin, "nameless")
    with pytest.raises(PluginError, match="no string 'name'"):
        backends("composer")


def test_duplicate_names_are_rejected(registered):
    plugin = types.SimpleNamespace()

    class Other(reverse_alpha_composer.ReverseAlphaComposer):
        name = "relevance"

    @hookimpl
    def register_composers(register):
        register(Other)

    plugin.register_composers = register_composers
    registered(plugin, "dup")
    with pytest.raises(PluginError, match="registered twice"):
        backends("composer")


def test_options_are_validated():
    with pytest.raises(ConfigError, match="unknown option.*colour"):
        build("composer", BackendSpec("relevance", {"colour": "red"}))
    with pytest.raises(ConfigError, match="most_relevant"):
        build("composer", BackendSpec("relevance", {"most_relevant": "middle"}))


def test_plugin_modules_load_lazily():
    import subprocess
    import sys

    code = (
        "import sys, inferscale; "
        "assert not any(m.endswith('.plugin') for m in sys.modules if m.startswith('inferscale')), sorted(sys.modules); "
        "from inferscale.plugins import backends; backends('composer'); "
        "assert 'inferscale.compose.plugin' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_selects_every_builtin_default():
    config = Config()
    for kind in BUILTINS:
        spec = getattr(config, kind)
        assert spec.name in backends(kind), kind
    importlib.import_module("inferscale.plugins")
