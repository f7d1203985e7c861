"""benchmarks/engine_profile.py: reading py-spy's raw stacks back into a row's busy, waiting and working shares."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engine_profile  # noqa: E402

RAW = """\
thread (0x7F01);run_busy_loop (vllm/v1/engine/core.py:700);schedule (vllm/v1/core/sched/scheduler.py:300) 300
thread (0x7F01);run_busy_loop (vllm/v1/engine/core.py:700);get_num_new_matched_tokens (inferscale/connector/vllm_adapter.py:130);plan_request (inferscale/inject/planner.py:74) 100
thread (0x7F01);run_busy_loop (vllm/v1/engine/core.py:700);sched_yield (vllm/distributed/utils.py:46) 500
thread (0x7F02);Thread.run (threading.py:982);Condition.wait (threading.py:327) 40
"""


def test_summary_of_the_busiest_thread(tmp_path):
    path = tmp_path / "100u_kv@0_0_EngineCore.txt"
    path.write_text(RAW)
    summary = engine_profile.summarize(path, seconds=10.0, rate=100)  # 1,000 samples a thread at most
    assert summary["busy"] == 0.9 and summary["waiting"] == 0.5 and summary["working"] == 0.4
    assert summary["inferscale"] == 0.1 and summary["threads"] == 2
    assert summary["self"][0] == ("sched_yield (utils.py)", 0.5)
    assert ("plan_request (planner.py)", 0.1) in summary["self"]
    assert "working 40% of the row (busy 90%), InferScale 10.0%" in engine_profile.line("EngineCore", summary)


def test_no_file_no_profile(tmp_path):
    assert engine_profile.summarize(tmp_path / "missing.txt", 10.0) is None
    assert engine_profile.line("Worker", None) == "  Worker: no profile"


def test_profile_needs_py_spy(monkeypatch):
    import vllm_serve_load

    monkeypatch.setenv("PY_SPY", "/nonexistent/py-spy")
    with pytest.raises(SystemExit):
        vllm_serve_load.main(["--shape", "smoke", "--profile", "/tmp/unused"])


def test_table_takes_the_median_over_rounds():
    def summary(working):
        return {"busy": working + 0.1, "waiting": 0.1, "working": working, "inferscale": 0.02,
                "self": [("schedule (scheduler.py)", 0.2)]}

    runs = [{"users": 100, "system": "kv@0", "profile": {"EngineCore": summary(w), "APIServer": None}}
            for w in (0.5, 0.7, 0.6)]
    runs.append({"users": 100, "system": "none"})  # a row run without --profile
    text = engine_profile.table(runs)
    assert text.count("\n") == 3 and "| 100 | kv@0 | EngineCore | 60 (50-70) | 70 | 2.0 | 0.0 | schedule (scheduler.py) 20.0 |" in text
    assert engine_profile.table([{"users": 1, "system": "none"}]) == ""


def test_a_wait_is_told_by_its_whole_name(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text("thread (0x1);step (core.py:1);wait_for_layer_load (inferscale/connector/vllm_adapter.py:264) 30\n"
                    "thread (0x1);step (core.py:1);HeldBlocks.select (inferscale/storage/blocks.py:87) 20\n"
                    "thread (0x1);step (core.py:1);Event.synchronize (torch/cuda/streams.py:1) 50\n")
    summary = engine_profile.summarize(path, seconds=1.0, rate=100)
    assert summary["waiting"] == 0.5 and summary["working"] == 0.5  # only synchronize waits


def test_forward_passes_without_cuda_graphs_are_told_apart(tmp_path):
    """A stack through vLLM's CUDA-graph wrapper that replays a graph is a graph; one that runs the
    compiled pieces (a step larger than any captured) is not."""
    wrapper = ("execute_model (vllm/v1/worker/gpu/model_runner.py:1361);"
               "CUDAGraphWrapper.__call__ (vllm/compilation/cuda_graph.py:254)")
    path = tmp_path / "rows.txt"
    path.write_text(f"thread (0x1);step (core.py:1);{wrapper};PiecewiseBackend.__call__ (p.py:380);Runner.call (c.py:623) 30\n"
                    f"thread (0x1);step (core.py:1);{wrapper};CUDAGraph.replay (torch/cuda/graphs.py:88) 20\n"
                    "thread (0x1);step (core.py:1);schedule (scheduler.py:300) 50\n")
    summary = engine_profile.summarize(path, seconds=1.0, rate=100)
    assert summary["eager"] == 0.3
