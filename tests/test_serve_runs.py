"""The load and fault runs in their short forms, as CI makes them: the real `inferscale serve`
(front and engine, tiny Qwen2) on loopback, driven by benchmarks/serve_load.py and
benchmarks/serve_faults.py; their long forms wrote benchmarks/results/serve_{load,faults}_cpu.*."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def run(script: str, out: Path, *args: str, timeout_s: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, f"benchmarks/{script}.py", *args, "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)
    assert out.with_suffix(".json").is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.with_suffix(".json").read_text())


def test_a_short_load_run_fails_no_request_and_shows_no_user_another_ones_facts(tmp_path):
    proc, result = run("serve_load", tmp_path / "load", "--model", "tiny", "--users", "10", "--seconds", "30")
    summary = result["summary"]
    assert proc.returncode == 0, summary["failures"]
    assert summary["failed"] == summary["failed_outside_load"] == summary["leaks"] == 0
    assert summary["chats"] > 50 and all(summary["writes"][kind] > 0 for kind in ("add", "update", "delete", "forget"))
    assert summary["chat_fallbacks"].get("None", 0) > summary["chats"] / 2  # most chats got their memory injected
    assert summary["server_log_errors"] == 0 and summary["front_exit_code"] == 0
    assert len(result["memory"]) >= 6
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "load.png").stat().st_size > 0


def test_one_fault_round_loses_no_committed_fact_and_leaves_nothing_half_written(tmp_path):
    proc, result = run("serve_faults", tmp_path / "faults", "--rounds", "1")
    (rnd,) = result["rounds"]
    assert proc.returncode == 0 and result["ok"], rnd["problems"]
    assert rnd["writes_ok"] > 0 and rnd["writes_cut"] > 0 and len(rnd["planted"]) == 3
    assert set(rnd["checks"]) >= {
        "every process of the server gone", "nothing left over after the restart", "no committed fact lost",
        "state is committed or committed + the write in flight, whole", "chat over all facts injects them",
        "K/V verified by the store's checksums", "the half-written user is not listed"}
