"""The cheap name check on load (inferscale.config.names) agrees with the plugins."""

import subprocess
import sys

import pytest

from inferscale import BackendSpec, Config, hookimpl
from inferscale.config import BACKEND_DEFAULTS, BUILTIN_NAMES
from inferscale.plugins import KINDS, backends, pm
from plugins import reverse_alpha_composer


def test_the_config_checks_every_kind_of_backend():
    assert set(BACKEND_DEFAULTS) == set(BUILTIN_NAMES) == set(KINDS)
    assert all(BACKEND_DEFAULTS[kind] == getattr(Config(), kind).name for kind in KINDS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_built_in_names_are_what_the_built_in_plugins_register(kind):
    names: set[str] = set()
    for plugin_name in ("inferscale.retrieval.plugin", "inferscale.storage.plugin", "inferscale.encode.plugin",
                        "inferscale.compose.plugin"):
        backends(kind)  # loads the plugins
        hook = getattr(pm.get_plugin(plugin_name), KINDS[kind], None)
        if hook is not None:
            hook(register=lambda cls: names.add(cls.name))
    assert BUILTIN_NAMES[kind] == names - {"jasper", "cagra"}


def test_loading_a_config_of_built_in_names_imports_no_backend():
    code = ("import sys\n"
            "from inferscale.config import Config\n"
            "Config.from_dict({'retriever': 'faiss', 'kv_store': 'disk', 'window': 'turns', 'embedder': 'openai'})\n"
            "loaded = [m for m in sys.modules if m.startswith(('inferscale.plugins', 'inferscale.storage',\n"
            "                                                  'inferscale.retrieval', 'faiss'))]\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_name_a_plugin_registers_loads():
    plugin = type("Plugin", (), {})()

    @hookimpl
    def register_composers(register):
        register(reverse_alpha_composer.ReverseAlphaComposer)

    plugin.register_composers = register_composers
    pm.register(plugin, name="reverse-alpha-on-load")
    try:
        assert Config.from_dict({"composer": "reverse-alpha"}).composer == BackendSpec("reverse-alpha")
    finally:
        pm.unregister(plugin)
