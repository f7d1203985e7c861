"""benchmarks/tradeoff.py: an accuracy run joined with a load run, from the H200 results in the repository."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import tradeoff  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT, BASELINE = "kv[window=-5,closing=answer,recompute_tokens=256]", "prompt[closing=answer]"


def test_every_method_gets_the_throughput_of_what_it_spends(tmp_path):
    out = tmp_path / "tradeoff"
    tradeoff.main(["--accuracy", str(RESULTS / "locomo_tradeoff_qwen15_h200.json"),
                   "--load", str(RESULTS / "vllm_serve_load_budgets_run17_h200.json"),
                   "--default", DEFAULT, "--baseline", BASELINE, "--out", str(out)])
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["default"] == DEFAULT and result["baseline"] == BASELINE
    by_name = {p["method"]: p for p in result["points"]}
    assert by_name[BASELINE]["system"] == "prompt" and by_name[BASELINE]["x_prompt"] == 1.0
    assert by_name[DEFAULT]["system"] == "kv@256"
    # the key scale and the encoding cost nothing per request: the same system as B = 0
    assert by_name["kv[slots=0/5/20,closing=answer]"]["system"] == "kv@0"
    assert by_name["kv[window=-5,closing=answer,key_scale=0.95]"]["system"] == "kv@0"
    assert out.with_suffix(".png").stat().st_size > 10_000 and "(default)" in out.with_suffix(".md").read_text()


def test_a_default_without_a_throughput_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not among the methods"):
        tradeoff.main(["--accuracy", str(RESULTS / "locomo_tradeoff_qwen15_h200.json"),
                       "--load", str(RESULTS / "vllm_serve_load_budgets_run17_h200.json"),
                       "--default", "kv[nope]", "--baseline", BASELINE, "--out", str(tmp_path / "t")])


def test_short_names_drop_the_closing_line():
    assert tradeoff.short_name(DEFAULT) == "kv[window=-5,recompute_tokens=256]"
    assert tradeoff.short_name(BASELINE) == "prompt"
