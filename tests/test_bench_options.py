"""How benchmarks/ttft.py turns a --kv-stores entry into the connector's options, and the
interval it puts around a within-round median."""

from __future__ import annotations

import importlib.util
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    ("copybelow0", {"pinned_reads": "overlap", "pinned_copy_below_mib": 0}),
    ("graphs+copybelow64", {"pinned_reads": "overlap", "pinned_read_graphs": True, "pinned_copy_below_mib": 64}),
    ("groups0", None), ("programs", None), ("programs-3", None), ("fast", None), ("groups8+", None),
    ("+", None),
])
def test_store_suffixes(suffix, expected):
    options = ttft_module().store_options(suffix)
    assert options == expected
    if options is not None:  # every option the benchmark sets is one the connector accepts
        Config(**options)


def test_a_store_entry_names_a_memory_store_and_its_options():
    ttft = ttft_module()
    assert ttft.parse_store("pinned:graphs+groups4") == (
        "pinned", {"pinned_reads": "overlap", "pinned_read_graphs": True, "pinned_read_launches": 4})
    assert ttft.parse_store("hbm") == ("hbm", {})
    for bad in ("disk", "pinned:zero", "hbm:groups0"):
        with pytest.raises(ValueError, match="hbm or pinned"):
            ttft.parse_store(bad)


def test_unknown_suffix_is_refused_before_any_engine_starts():
    done = subprocess.run([sys.executable, "benchmarks/ttft.py", "--kv-stores", "hbm,pinned:zero"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pinned:zero" in done.stderr and "programs<n>" in done.stderr


def test_median_interval_order_statistics():
    """n = 40: P(Binomial(40, 1/2) <= 13) = 0.019 <= 0.025 < P(<= 14) = 0.040, so the 95 % interval
    runs from the 14th to the 27th smallest value; too few values give no interval."""
    ttft = ttft_module()
    assert ttft.median_interval([float(v) for v in range(40)]) == (13.0, 26.0)
    assert ttft.median_interval([3.0, 1.0, 2.0, 5.0, 4.0, 0.0]) == (0.0, 5.0)  # n = 6: 2 × 1/64 ≤ 0.05
    low, high = ttft.median_interval([1.0, 2.0, 3.0, 4.0, 5.0])  # n = 5: 2 × 1/32 > 0.05
    assert math.isnan(low) and math.isnan(high)
    assert ttft.paired_interval([5.0] * 40, [float(v) for v in range(40)]) == (-21.0, -8.0)


def test_median_interval_covers_the_median_as_often_as_it_says():
    """Over many samples of 40 rounds (skewed, as latencies are), the interval holds the true
    median at least 95 % of the time, and not so much more that it is needlessly wide."""
    ttft = ttft_module()
    rng = random.Random(7)
    true_median = math.log(2)  # of an exponential with rate 1
    trials = 4000
    covered = 0
    for _ in range(trials):
        low, high = ttft.median_interval([rng.expovariate(1.0) for _ in range(40)])
        covered += low <= true_median <= high
    assert 0.95 <= covered / trials <= 0.985


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=6, max_size=80), st.sampled_from([0.8, 0.9, 0.95, 0.99]))
def test_median_interval_holds_the_sample_median_and_widens_with_confidence(values, confidence):
    ttft = ttft_module()
    low, high = ttft.median_interval(values, confidence)
    if math.isnan(low):
        return
    assert low <= statistics.median(values) <= high
    wider = ttft.median_interval(values, min(0.999, confidence + 0.009))
    assert math.isnan(wider[0]) or (wider[0] <= low and high <= wider[1])
