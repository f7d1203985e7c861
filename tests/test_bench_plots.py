"""Benchmark plots drawn again from results kept in the repository (no GPU needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_fused_write_speed_draws_the_contention_table_of_a_saved_result(tmp_path):
    saved = REPO / "benchmarks" / "results" / "fused_write_speed_h200_run11.json"
    out = tmp_path / "again.json"
    done = subprocess.run([sys.executable, "benchmarks/fused_write_speed.py", "--plot", str(saved), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 20_000  # two panels, four lines each
    assert not out.exists()  # drawing never writes a result


def test_ttft_floor_gathers_saved_runs_and_draws_them(tmp_path):
    """Every saved run with vLLM's prefix cache gives a row per store and k; a run without it
    (no floor to show) gives none, and a command with only such runs is refused."""
    import json

    results = REPO / "benchmarks" / "results"
    out = tmp_path / "floor.json"
    runs = [results / "ttft_llama8b_h200_run12b.json", results / "ttft_llama8b_h200_run11_noprefix.json"]
    done = subprocess.run([sys.executable, "benchmarks/ttft_floor.py", *map(str, runs), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    saved = json.loads(out.read_text())
    assert {(r["run"], r["kv_store"], r["k"]) for r in saved["rows"]} == {
        ("ttft_llama8b_h200_run12b", store, 50) for store in ("hbm", "pinned", "pinned:groups4")}
    hbm = next(r for r in saved["rows"] if r["kv_store"] == "hbm")
    assert abs(hbm["kv_vs_none"] - 1.115) < 1e-3 and abs(hbm["cached_vs_none"] - 1.002) < 1e-3
    assert [(s["store"], s["runs"]) for s in saved["summary"]] == [("hbm", 1), ("pinned", 2)]
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    refused = subprocess.run([sys.executable, "benchmarks/ttft_floor.py", str(runs[1]), "--out", str(tmp_path / "x.json")],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "prefix cache" in refused.stderr
