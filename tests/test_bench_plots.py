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
