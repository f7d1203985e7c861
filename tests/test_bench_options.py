"""How benchmarks/ttft.py turns a --kv-stores entry into the connector's options."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from inferscale.config import Config

REPO = Path(__file__).resolve().parents[1]


def ttft_module():
    spec = importlib.util.spec_from_file_location("ttft_bench", REPO / "benchmarks" / "ttft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("suffix, expected", [
    ("", {}), ("copy", {"pinned_reads": "copy"}), ("launch", {"write_graphs": False}),
    ("programs32", {"pinned_reads": "overlap", "pinned_read_programs": 32}),
    ("programs16+groups8", {"pinned_reads": "overlap", "pinned_read_programs": 16, "pinned_read_launches": 8}),
    ("launch+groups2", {"write_graphs": False, "pinned_reads": "overlap", "pinned_read_launches": 2}),
    ("programs0+groups4", {"pinned_reads": "overlap", "pinned_read_programs": 0, "pinned_read_launches": 4}),
    ("graphs+groups4", {"pinned_reads": "overlap", "pinned_read_graphs": True, "pinned_read_launches": 4}),
    ("groups0", None), ("programs", None), ("programs-3", None), ("fast", None), ("groups8+", None),
    ("+", None),
])
def test_store_suffixes(suffix, expected):
    options = ttft_module().store_options(suffix)
    assert options == expected
    if options is not None:  # every option the benchmark sets is one the connector accepts
        Config(**options)


def test_unknown_suffix_is_refused_before_any_engine_starts():
    done = subprocess.run([sys.executable, "benchmarks/ttft.py", "--kv-stores", "hbm,pinned:zero"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pinned:zero" in done.stderr and "programs<n>" in done.stderr
