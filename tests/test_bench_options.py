"""How benchmarks/ttft.py turns a --kv-stores entry into the connector's options, and the
interval it puts around a within-round median, and the goal it holds each row against."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.config import Tuning

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
    ("async", {"async_loads": "always"}), ("copy+sync", {"pinned_reads": "copy", "async_loads": "never"}),
    ("groups0", None), ("programs", None), ("programs-3", None), ("fast", None), ("groups8+", None),
    ("+", None),
])
def test_store_suffixes(suffix, expected):
    options = ttft_module().store_options(suffix)
    assert options == expected
    if options is not None:  # every option the benchmark sets is one the connector accepts
        Tuning(**options)


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


def test_goal_verdicts_of_a_saved_h200_run():
    """The goal column read off the eleventh H200 block's second machine: the hbm store could not
    tell at k = 50 (1.089-1.152), missed at k = 100 (1.172-1.255); the pinned store met 1.2x its
    PCIe floor at k = 100 (3.44-5.07 ms, limit 5.72), could not tell at k = 50 (2.51-3.17 ms, limit
    2.88); the goals are not set at k = 1 or 10."""
    ttft = ttft_module()
    saved = json.loads((REPO / "benchmarks/results/ttft_llama8b_h200_run13b.json").read_text())
    gets = {int(k): v for k, v in saved["store_get"].items()}
    verdicts = {(r["kv_store"], r["k"]): ttft.goal(r, gets) for r in saved["rows"]}
    assert {key: v and v["verdict"] for key, v in verdicts.items()} == {
        ("hbm", 1): None, ("hbm", 10): None, ("hbm", 50): "undecided", ("hbm", 100): "missed",
        ("pinned", 1): None, ("pinned", 10): None, ("pinned", 50): "undecided", ("pinned", 100): "met"}
    assert verdicts[("pinned", 100)]["limit"] == pytest.approx(1.2 * gets[100]["pcie_floor_ms"])
    assert ttft.goal_cell(verdicts[("hbm", 100)]) == "KV / none ≤ 1.10: missed"


def test_goal_needs_full_injection_and_a_floor():
    ttft = ttft_module()
    row = {"kv_store": "pinned:copybelow0", "k": 50, "recompute_tokens": 0,
           "kv_minus_none_ci_ms": (1.0, 2.0), "kv_vs_none_paired_ci": (1.05, 1.08)}
    assert ttft.goal(row, {}) is None  # no GPU, no floor
    assert ttft.goal(row, {50: {"pcie_floor_ms": 2.0}})["verdict"] == "met"
    assert ttft.goal(dict(row, recompute_tokens=256), {50: {"pcie_floor_ms": 2.0}}) is None
    nan = float("nan")  # too few rounds for an interval: the run cannot tell
    assert ttft.goal(dict(row, kv_store="hbm", kv_vs_none_paired_ci=(nan, nan)), {})["verdict"] == "undecided"
    assert ttft.goal(dict(row, kv_store="hbm", kv_vs_none_paired_ci=(1.11, 1.2)), {})["verdict"] == "missed"


def test_prefix_cache_goal_reads_the_interval_of_kv_minus_the_cached_head():
    """KV injection within 1 ms of vLLM's own prefix-cache hit of the same head: met when the whole
    95 % interval of the within-round difference is under 1 ms, missed when all of it is over."""
    ttft = ttft_module()
    row = {"k": 50, "cached_ms": 9.0}
    assert ttft.prefix_cache_goal({**row, "kv_minus_cached_ci_ms": (0.6, 0.9)})["verdict"] == "met"
    assert ttft.prefix_cache_goal({**row, "kv_minus_cached_ci_ms": (0.8, 1.2)})["verdict"] == "undecided"
    assert ttft.prefix_cache_goal({**row, "kv_minus_cached_ci_ms": (1.1, 1.9)})["verdict"] == "missed"
    assert ttft.prefix_cache_goal({**row, "k": 10, "kv_minus_cached_ci_ms": (0.1, 0.2)}) is None
    assert ttft.prefix_cache_goal({"k": 50, "cached_ms": math.nan, "kv_minus_cached_ci_ms": (0.1, 0.2)}) is None


def load_module():
    spec = importlib.util.spec_from_file_location("serve_load_bench", REPO / "benchmarks" / "vllm_serve_load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_the_load_run_names_the_default_by_its_accuracy_method():
    import argparse

    load, parser = load_module(), argparse.ArgumentParser()
    systems = ["none", "kv@0", "kv@256", "prompt"]
    method = "kv[window=-5,closing=answer,recompute_tokens=256]"
    assert load.parse_default(f"{method}=kv@256", systems, parser) == (method, "kv@256")
    assert load.parse_default(None, systems, parser) is None
    for bad in (f"{method}=kv@16", "kv@256", "=kv@0"):
        with pytest.raises(SystemExit):
            load.parse_default(bad, systems, parser)


def test_the_releases_table_sets_each_release_beside_the_other(tmp_path):
    results = REPO / "benchmarks" / "results"
    out = tmp_path / "releases"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "releases_table.py"),
                    "--release", "0.26.0", str(results / "ttft_llama8b_vllm026_run21_h200.json"),
                    str(results / "vllm_serve_load_vllm026_run21_h200.json"),
                    "--release", "0.33.0", str(results / "ttft_llama8b_vllm033_h200.json"),
                    str(results / "vllm_serve_load_vllm033_h200.json"), "--out", str(out)],
                   check=True, capture_output=True)
    table = json.loads(out.with_suffix(".json").read_text())
    assert table["releases"] == ["0.26.0", "0.33.0"]
    for release in table["releases"]:
        assert {(r["kv_store"], r["k"]) for r in table["ttft"][release]} == {
            (s, k) for s in ("hbm", "pinned") for k in (10, 50, 100)}
        load = table["load_100_users"][release]
        assert set(load) == {"none", "kv@0", "kv@256", "prompt"} and load["kv@0"] > load["prompt"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| kv@0 | 225.9 (5.55×) | 189.7 (4.59×) |" in md


def test_kv_calibration_reproduces_the_text_exactly_and_fits_scales_that_lower_the_kl(tmp_path):
    """Read behind exactly what each fact was encoded behind, the injected K/V are the text's own:
    the KL before fitting is ~0 (fp32). Read in another order, fitting the scales lowers it."""
    import tiny_models

    model = tiny_models.tiny_model_dir("qwen2", "float32")
    facts = tmp_path / "facts.txt"
    facts.write_text("\n".join(f"{name} {what}." for name in ("Ana", "Bo", "Cy", "Di") for what in
                               ("lives in Lima", "plays the violin", "has two dogs", "was born in May 1990")))
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO)}

    def run(*extra: str) -> dict:
        out = tmp_path / f"calibration{len(list(tmp_path.glob('calibration*.json')))}.json"
        subprocess.run([sys.executable, str(REPO / "benchmarks" / "kv_calibration.py"), "--model", str(model),
                        "--facts", str(facts), "--samples", "3", "--held-out", "1", "--answer-tokens", "4",
                        "--out", str(out), *extra], check=True, capture_output=True, env=env, timeout=600)
        return json.loads(out.read_text())

    exact = run("--k", "8", "--pool", "8", "--window", "8", "--stored-order", "--steps", "0")
    assert exact["kl_before"]["train"] < 1e-6 and exact["kl_before"]["held_out"] < 1e-6
    fitted = run("--k", "6", "--pool", "12", "--window", "2", "--steps", "30", "--lr", "0.05")
    assert fitted["kl_before"]["train"] > 1e-5  # other contexts: not the text's own K/V
    assert fitted["kl_after"]["train"] < fitted["kl_before"]["train"]
    layers = len(fitted["key_scale"])
    assert layers == len(fitted["value_scale"]) > 0 and all(len(row) == len(fitted["key_scale"][0]) for row in fitted["key_scale"])
    # per channel, with shifts; and the KL on LoCoMo questions, which the fit never sees
    locomo = REPO.parent / "shared" / "data" / "locomo"
    channel = run("--k", "4,6", "--pool", "12", "--window", "2", "--steps", "30", "--lr", "0.05", "--form", "channel",
                  *(("--locomo", str(locomo), "--locomo-questions", "2") if locomo.is_dir() else ()))
    assert channel["form"] == "channel" and channel["k"] == [4, 6]
    assert channel["kl_after"]["train"] < channel["kl_before"]["train"]
    from inferscale.encode.calibration import KVCalibration

    fitted_file = KVCalibration.load(sorted(tmp_path.glob("calibration*.json"))[-1])
    assert fitted_file.form == "channel" and fitted_file.key_shift is not None and fitted_file.shape[0] == layers
    if locomo.is_dir():
        assert channel["locomo_questions"] == 2 and channel["kl_before"]["locomo"] > 1e-5 and channel["kl_after"]["locomo"] > 0


def load_rows_module():
    spec = importlib.util.spec_from_file_location("load_rows", REPO / "benchmarks" / "load_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_load_run_interleaves_its_rounds_and_parses_its_budgets():
    load = load_module()
    assert load.kv_systems("adaptive,0,256") == ["kv@adaptive", "kv@0", "kv@256"]
    assert load.request_budget("kv@adaptive") is None and load.request_budget("kv@64") == 64
    for bad in ("auto", "-1", "1.5"):
        with pytest.raises(ValueError):
            load.kv_systems(bad)
    systems = ["none", "kv@adaptive", "kv@0", "prompt"]
    assert load.rounds([1, 10], 2, systems) == [
        (users, repeat, system) for users in (1, 10) for repeat in (0, 1)
        for system in ("prompt", "kv@adaptive", "kv@0", "none")]


def _run(users, system, repeat, rate, **extra):
    return {"users": users, "system": system, "repeat": repeat, "requests_per_s": rate, "requests": 10,
            "failed": 0, "errors": [], "latency_p50_ms": None, **extra}


def test_repeated_rows_are_medians_with_their_spread_and_ratios_taken_within_each_round():
    rows = load_rows_module()
    runs = [_run(100, "prompt", 0, 40.0), _run(100, "kv@0", 0, 240.0), _run(100, "none", 0, 300.0),
            _run(100, "prompt", 1, 50.0), _run(100, "kv@0", 1, 250.0), _run(100, "none", 1, 250.0),
            _run(100, "prompt", 2, 45.0), _run(100, "kv@0", 2, 180.0), _run(100, "none", 2, 270.0)]
    by = {r["system"]: r for r in rows.aggregate(runs)}
    kv = by["kv@0"]
    assert kv["repeats"] == 3 and kv["requests"] == 30 and kv["requests_per_s"] == 240.0
    assert kv["users"] == 100 and isinstance(kv["users"], int) and "repeat" not in kv
    assert kv["requests_per_s_spread"] == {"median": 240.0, "min": 180.0, "max": 250.0}
    assert kv["x_prompt"] == {"median": 5.0, "min": 4.0, "max": 6.0}  # 6.0, 5.0, 4.0: each round's own
    assert kv["x_none"]["median"] == pytest.approx(0.8) and kv["x_none"]["max"] == 1.0
    assert by["prompt"]["x_prompt"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert "latency_p50_ms" not in kv  # a number no run measured has no median
    assert rows.cell(kv["x_prompt"]) == "5.00 (4.00-6.00)" and rows.cell(by["prompt"]["x_prompt"]) == "1.00"


def test_the_budgets_chosen_are_pooled_over_the_repeats():
    rows = load_rows_module()
    idle = {"fallback": None, "recompute_budget": 256, "recomputed_tokens": 240, "engine_busy": False}
    busy = {"fallback": None, "recompute_budget": 0, "recomputed_tokens": 0, "engine_busy": True}
    refused = {"fallback": "refused", "recompute_budget": 0, "recomputed_tokens": 0, "engine_busy": None}
    first = rows.budget_summary([idle, busy, busy, busy, refused, None])
    assert first == {"budget_mean": 64.0, "budget_histogram": {"0": 3, "256": 1}, "recomputed_mean": 60.0,
                     "busy_share": 0.75, "reported": 4}
    second = rows.budget_summary([idle] * 4)
    assert rows.budget_summary([refused, None]) == {}
    row = rows.aggregate([_run(10, "kv@adaptive", 0, 1.0, **first), _run(10, "kv@adaptive", 1, 1.0, **second)])[0]
    assert row["budget_histogram"] == {"0": 3, "256": 5} and row["budget_mean"] == 160.0
    assert row["recomputed_mean"] == 150.0 and row["busy_share"] == 0.375
    assert rows.budget_cell(row) == "160 (0: 3, 256: 5)"
    fixed = rows.budget_summary([{"fallback": None, "recompute_budget": 0, "recomputed_tokens": 0,
                                  "engine_busy": None}])
    assert fixed["busy_share"] is None and rows.aggregate([_run(1, "kv@0", 0, 1.0, **fixed)])[0]["busy_share"] is None


def test_the_load_run_sets_stores_side_by_side_a_server_each():
    load = load_module()
    assert load.server_specs("pinned") == [("pinned", "pinned", {})]
    assert load.server_specs("hbm:never, pinned:auto:copy") == [
        ("hbm:never", "hbm", {"async_loads": "never"}),
        ("pinned:auto:copy", "pinned", {"async_loads": "auto", "pinned_reads": "copy"})]
    assert load.server_specs("pinned:auto:overlap:2064") == [
        ("pinned:auto:overlap:2064", "pinned", {"async_loads": "auto", "pinned_reads": "overlap",
                                                "before_forward_tokens": 2064})]
    # any other [tuning] field by name, after the positional ones, typed as its default
    assert load.server_specs("pinned:never:pinned_copy_below_mib=0:pinned_copy_above_mib=0.5:write_graphs=false") == [
        ("pinned:never:pinned_copy_below_mib=0:pinned_copy_above_mib=0.5:write_graphs=false", "pinned",
         {"async_loads": "never", "pinned_copy_below_mib": 0.0, "pinned_copy_above_mib": 0.5, "write_graphs": False})]
    assert load.server_specs("pinned:user_read_threads=2")[0][2] == {"user_read_threads": 2}
    for bad in ("disk", "pinned:sometimes", "pinned:never:dma", "pinned:never:copy:x", "pinned::copy", "hbm,hbm", "",
                "pinned:auto,pinned:auto", "pinned:auto:copy:-1", "pinned:auto:copy:12:1",
                "pinned:speed=1", "pinned:to_dict=1", "pinned:user_read_threads=two", "pinned:user_read_threads=0", "pinned:write_graphs=1",
                "pinned:never:async_loads=auto", "pinned:pinned_copy_below_mib=0:auto"):
        with pytest.raises(ValueError):
            load.server_specs(bad)
    # a spec's tuning over the command line's, the command line's over Tuning's defaults
    args = load.argparse.Namespace(tail_max_step_tokens=None, tail_max_waiting=None, pinned_reads="copy",
                                   async_loads="always", layerwise_write=False)
    assert (load.tuning_of(args).async_loads, load.tuning_of(args).pinned_reads) == ("always", "copy")
    tuning = load.tuning_of(args, **load.server_specs("pinned:never:overlap")[0][2])
    assert (tuning.async_loads, tuning.pinned_reads) == ("never", "overlap")
    assert load.tuning_of(args, **load.server_specs("pinned:auto:copy:1032")[0][2]).before_forward_tokens == 1032
    # one server: the systems as ever; several: each KV system on each, a store's rows back to back
    assert load.run_systems(["kv@0"], ["pinned"]) == ["none", "kv@0", "prompt"]
    both = load.run_systems(["kv@0", "kv@adaptive"], ["hbm", "pinned:auto"])
    assert both == ["none", "kv@0 on hbm", "kv@0 on pinned:auto", "kv@adaptive on hbm", "kv@adaptive on pinned:auto",
                    "prompt"]
    assert [load.request_budget(s) for s in both[1:-1]] == [0, 0, None, None]
    servers = [load.Server(label, None, f"http://{label}", None) for label in ("hbm", "pinned:auto")]
    assert [load.server_of(s, servers).label for s in both] == ["hbm", "hbm", "pinned:auto", "hbm", "pinned:auto",
                                                                 "hbm"]
    # counters over the timed runs, per server when there are several
    assert load.counted_since({"hbm": {"a": 1.0}}, {"hbm": {"a": 3.0, "b": 2.0}}) == {"a": 2.0, "b": 2.0}
    assert load.counted_since({"hbm": {"a": 1.0}, "pinned": {}}, {"hbm": {"a": 4.0}, "pinned": {"a": 1.0}}) == {
        "hbm": {"a": 3.0}, "pinned": {"a": 1.0}}


def test_stores_side_by_side_are_compared_within_each_round():
    """Each store's ratio to prompt injection is taken in the rounds it ran, so a round where the
    machine was slower moves every store alike; the table names each server's store and mode."""
    load = load_module()
    import load_rows

    rates = {"prompt": (40.0, 30.0), "kv@0 on hbm": (200.0, 150.0), "kv@0 on pinned:auto": (190.0, 144.0),
             "none": (300.0, 225.0)}
    runs = [{"users": 100, "system": system, "repeat": repeat, "requests_per_s": rate[repeat], "requests": 10,
             "failed": 0, "output_tokens_per_s": 1.0, "latency_p50_ms": 1.0, "latency_p99_ms": 1.0}
            for repeat in (0, 1) for system, rate in rates.items()]
    rows = {row["system"]: row for row in load_rows.aggregate(runs, "hbm")}
    assert rows["kv@0 on hbm"]["x_prompt"]["min"] == rows["kv@0 on hbm"]["x_prompt"]["max"] == 5.0
    assert rows["kv@0 on pinned:auto"]["x_prompt"]["median"] == pytest.approx((4.75 + 4.8) / 2)
    # and each store against the first, round by round (190 / 200, 144 / 150)
    assert rows["kv@0 on pinned:auto"]["x_first_store"] == pytest.approx({"median": 0.955, "min": 0.95, "max": 0.96})
    assert rows["kv@0 on hbm"]["x_first_store"]["median"] == 1.0 and "x_first_store" not in rows["prompt"]
    result = {"model": "m", "command": "c", "facts_per_user": 60, "k": 50, "memory_tokens": 1032,
              "question_tokens": 16, "max_tokens": 32, "seconds": 20, "repeats": 2, "kv_store": "hbm,pinned:auto",
              "servers": [{"label": "hbm", "kv_store": "hbm", "async_loads": "never", "pinned_reads": "overlap"},
                          {"label": "pinned:auto", "kv_store": "pinned", "async_loads": "auto",
                           "pinned_reads": "overlap"}],
              "warm_up": {}, "rows": list(rows.values()), "runs": runs}
    table = load.table(result)
    assert "side by side" in table and "pinned:auto (async_loads auto, pinned_reads overlap)" in table
    assert "| 100 | kv@0 on pinned:auto | 167.00 (144.00-190.00) |" in table
    assert "| × kv@B on hbm |" in table and "| 0.955 (0.950-0.960) |" in table


@pytest.mark.parametrize("levels", [[100], [1, 10, 100]])
def test_the_load_plot_draws_one_level_as_bars_and_several_as_lines(tmp_path, levels):
    """One level of users: a bar per system with its rounds' spread and ratio (no line of one
    point); several: lines against the users. Either way a PNG."""
    load = load_module()
    rows = [{"users": users, "system": system, "requests_per_s": rate, "ttft_mean_ms": 50.0,
             "requests_per_s_spread": {"median": rate, "min": rate * 0.9, "max": rate * 1.1},
             "x_prompt": {"median": rate / 40.0}} for users in levels for system, rate in (("prompt", 40.0),
                                                                                           ("kv@0", 200.0))]
    load.plot({"model": "m", "rows": rows}, tmp_path / "load.png")
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.pyplot as plt

    requests_axis = plt.gcf().axes[0]
    if len(levels) == 1:
        assert len(requests_axis.patches) == 2 and [t.get_text() for t in requests_axis.texts] == [
            "1.00× prompt", "5.00× prompt"]
    else:
        assert not requests_axis.patches and len(requests_axis.get_lines()) == 2
    plt.close("all")


def test_the_load_report_says_how_long_parked_requests_waited():
    load = load_module()
    counts = {"parked_requests_total": 4.0, "parked_schedules_total{until=reported}": 4.0,
              "parked_schedules_total{until=scheduled}": 10.0, "parked_seconds_total": 0.2}
    assert load.parked_waits(counts) == ("4 requests parked, waiting 1.00 schedules for the workers' report, "
                                         "2.50 until they ran, 50.0 ms")
    side = {"hbm:never": {"parked_requests_total": 0.0}, "pinned:auto": counts}
    assert load.parked_waits(side).startswith("pinned:auto: 4 requests parked")
    assert load.parked_waits({"parked_requests_total": 0.0}) == "" and load.parked_waits({}) == ""
