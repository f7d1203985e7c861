"""The LoCoMo screen (teacher-forced KL from prompt injection, gold-answer NLL) on a tiny model:
a method that recomputes every fact reads exactly what prompt injection reads (KL ~ 0), one that
injects them does not, and every method's pooled values and gaps come with intervals."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import tiny_models

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "locomo"
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.skipif(not DATA.is_dir(), reason="LoCoMo data not found: put LoCoMo's conversations, one JSON file each (conv-26.json, ...: the entries of data/locomo10.json at github.com/snap-research/locomo), in ../shared/data/locomo beside the checkout")
def test_the_screen_tells_injected_facts_from_recomputed_ones(tmp_path):
    import locomo_screen

    model = tiny_models.tiny_model_dir("qwen2", "float32")
    injected, recomputed = "kv[window=-10,closing=answer]", "kv[window=-10,closing=answer,recompute_tokens=100000]"
    stored = "prompt[closing=answer,order=stored]"
    fp8 = "kv[window=-10,closing=answer,at_rest=fp8_e4m3]"
    out = tmp_path / "screen.json"
    locomo_screen.main(["--model", str(model), "--data", str(DATA), "--sample", "8", "--ks", "5,10", "--cycle",
                        "--methods", ";".join([stored, injected, recomputed, fp8]), "--reference", injected,
                        "--retrieval", str(ROOT / "benchmarks" / "results" / "locomo_retrieval_minilm.json"),
                        "--out", str(out)])
    result = json.loads(out.read_text())
    summary = result["summary"]
    assert result["baseline"] == "prompt[closing=answer]" and result["questions"] == 8
    rows = result["rows"]
    assert {r["k"] for r in rows} == {5, 10} and len(rows) == 8 * 5  # each question at one k, 5 methods
    teacher = [r for r in rows if r["method"] == "prompt[closing=answer]"]
    assert all(r["kl"] == 0.0 for r in teacher)
    kl = {m: s["pooled"]["kl"]["mean"] for m, s in summary.items()}
    assert kl[recomputed] < 1e-4  # the prefix's K/V injected, every fact read as text: prompt injection's read
    assert kl[injected] > 100 * max(kl[recomputed], 1e-6)
    assert all(r["recomputed"] > 0 for r in rows if r["method"] == recomputed)
    # fp8 at rest: its round trip is what is read (every question moves), by little against the injection's own KL
    kl_of = {(r["method"], r["conv"], r["q"]): r["kl"] for r in rows}
    moved = [abs(kl_of[(fp8, c, q)] - kl_of[(injected, c, q)]) for m, c, q in kl_of if m == injected]
    assert min(moved) > 0 and sum(moved) / len(moved) < 0.5 * kl[injected], (moved, kl[injected])
    gap = summary[recomputed]["gap"]["kl"]["all"]
    assert gap["low"] <= gap["gap"] <= gap["high"] < 0 and gap["questions"] == 8
    nll = summary[injected]["pooled"]["nll"]
    assert nll["low"] <= nll["mean"] <= nll["high"]
    nll_gap = summary[recomputed]["gap"]["nll"]["all"]
    assert nll_gap["low"] <= nll_gap["gap"] <= nll_gap["high"]
    table = out.with_suffix(".md").read_text()
    assert "KL pooled" in table and "NLL − reference" in table and f"{nll_gap['gap']:+.3f}" in table


def test_the_f1_harness_names_where_fp8_at_rest_is_measured():
    import locomo

    with pytest.raises(SystemExit, match="locomo_screen.py"):
        locomo.usable([locomo.parse_method("kv[window=-10,at_rest=fp8_e4m3]")])
    assert locomo.parse_method("kv[window=-10,at_rest=fp8_e4m3]").at_rest == "fp8_e4m3"


def test_pooled_gaps_average_each_question_over_k_before_the_bootstrap():
    import locomo_gaps

    category = {("c", q): 1 if q < 3 else 4 for q in range(6)}
    base = {q: 0.5 for q in category}
    f1 = {("prompt", 5): dict(base), ("prompt", 10): dict(base),
          ("kv", 5): {q: 0.5 + (0.2 if q[1] % 2 else 0.0) for q in category},  # +0.2 on odd questions
          ("kv", 10): {q: 0.5 - 0.1 for q in category if q[1] != 5}}  # question 5 unanswered at k = 10
    pooled = locomo_gaps.pooled(category, f1, "prompt", resamples=500)["kv"]
    per_question = {q: ((0.2 if q % 2 else 0.0) - 0.1) / 2 for q in range(5)}  # question 5 left out
    assert pooled["all"]["questions"] == 5 and pooled["all"]["ks"] == [5, 10]
    assert pooled["all"]["gap"] == pytest.approx(sum(per_question.values()) / 5)
    assert pooled["multi-hop"]["gap"] == pytest.approx(sum(per_question[q] for q in range(3)) / 3)
    assert pooled["all"]["low"] < pooled["all"]["gap"] < pooled["all"]["high"]
    assert "temporal" not in pooled  # no temporal question
    table = locomo_gaps.pooled_markdown(locomo_gaps.pooled(category, f1, "prompt", resamples=100), "prompt")
    assert "| kv | 5/10 |" in table
