"""The write path (inferscale/inject/) imports without vLLM: every module of it, in a process
where vLLM cannot be imported at all."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import inferscale.inject

#: before anything else runs in the child: any import of vllm or vllm.* fails
NO_VLLM = """
import importlib.abc, sys

class NoVLLM(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"vllm is not importable here ({name})")
        return None

sys.meta_path.insert(0, NoVLLM())
"""


def inject_modules() -> list[str]:
    found = pkgutil.iter_modules(inferscale.inject.__path__)
    return ["inferscale.inject"] + [f"inferscale.inject.{module.name}" for module in found]


def test_the_write_path_has_its_modules():
    assert {"inferscale.inject.planner", "inferscale.inject.loader", "inferscale.inject.writer",
            "inferscale.inject.fused_write", "inferscale.inject.sources"} <= set(inject_modules())


def test_every_inject_module_imports_without_vllm():
    code = NO_VLLM + (
        "import importlib\n"
        f"for name in {inject_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_guard_does_keep_vllm_out():
    """(The check above is not vacuous: the adapter, which does need vLLM, fails under it.)"""
    code = NO_VLLM + "import inferscale.connector.vllm_adapter\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode != 0 and "vllm is not importable here" in done.stderr
