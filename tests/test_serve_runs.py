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


class Run:
    """One benchmark script, started in the background: the load run and the fault run each start
    their own server and share nothing, so the module starts both at once (its first test waits for
    its own; the other's is done by then, or nearly)."""

    def __init__(self, script: str, out: Path, *args: str, start: bool = True):
        self.out, self.cmd = out, [sys.executable, f"benchmarks/{script}.py", *args, "--out", str(out)]
        self.log = out.with_suffix(".log")
        self.proc = None
        if start:
            self.start()

    def start(self) -> None:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def result(self, timeout_s: float = 600) -> tuple[int, dict]:
        if self.proc is None:
            self.start()
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        output = self.log.read_text(errors="replace")
        assert self.out.with_suffix(".json").is_file(), output[-6000:]
        return code, json.loads(self.out.with_suffix(".json").read_text())


RUNS = {  # test name → the run it checks
    "test_a_short_load_run_fails_no_request_and_shows_no_user_another_ones_facts":
        ("serve_load", "load", "--model", "tiny", "--users", "10", "--seconds", "30"),
    "test_one_fault_round_loses_no_committed_fact_and_leaves_nothing_half_written":
        ("serve_faults", "faults", "--rounds", "1"),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The runs of the tests selected in this module, all started now (with a GPU, each when its
    test asks: every server's engine would claim most of the GPU's memory)."""
    import torch

    selected = {item.originalname for item in request.session.items if item.module is request.module}
    out = tmp_path_factory.mktemp("serve_runs")
    now = not torch.cuda.is_available()
    started = {name: Run(script, out / stem, *args, start=now) for name, (script, stem, *args) in RUNS.items()
               if name in selected}
    yield started
    for run in started.values():
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait(timeout=60)


def test_a_short_load_run_fails_no_request_and_shows_no_user_another_ones_facts(runs):
    run = runs["test_a_short_load_run_fails_no_request_and_shows_no_user_another_ones_facts"]
    returncode, result = run.result()
    summary = result["summary"]
    assert returncode == 0, summary["failures"]
    assert summary["failed"] == summary["failed_outside_load"] == summary["leaks"] == 0
    assert all(summary["writes"][kind] > 0 for kind in ("add", "update", "delete", "forget"))
    # answers kept coming: every user was answered under the load, and chats asked in either half of it
    start, end = result["phases"]["load_start"], result["phases"]["load_end"]
    users = {e["user"] for e in result["events"] if e["kind"] == "chat"}
    answered = [e for e in result["events"] if e["kind"] == "chat" and e["outcome"] == "ok" and e["t0"] >= start]
    assert len(users) == 10 and {e["user"] for e in answered} == users, users - {e["user"] for e in answered}
    assert any(e["t0"] < (start + end) / 2 for e in answered) and any(e["t0"] >= (start + end) / 2 for e in answered)
    assert summary["chat_fallbacks"].get("None", 0) > summary["chats"] / 2  # most chats got their memory injected
    assert summary["server_log_errors"] == 0 and summary["front_exit_code"] == 0
    assert len(result["memory"]) >= 6
    if importlib.util.find_spec("matplotlib") is not None:
        assert run.out.with_suffix(".png").stat().st_size > 0


def test_one_fault_round_loses_no_committed_fact_and_leaves_nothing_half_written(runs):
    returncode, result = runs["test_one_fault_round_loses_no_committed_fact_and_leaves_nothing_half_written"].result()
    (rnd,) = result["rounds"]
    assert returncode == 0 and result["ok"], rnd["problems"]
    assert rnd["writes_ok"] > 0 and rnd["writes_cut"] > 0 and len(rnd["planted"]) == 3
    assert set(rnd["checks"]) >= {
        "every process of the server gone", "nothing left over after the restart", "no committed fact lost",
        "state is committed or committed + the write in flight, whole", "chat over all facts injects them",
        "K/V verified by the store's checksums", "the half-written user is not listed"}
