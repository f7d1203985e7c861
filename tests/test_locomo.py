"""LoCoMo: every conversation loads as released, the accuracy harness scores and runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import tiny_models
from inferscale.datasets.locomo import load_all, load_conversation, stratified_sample, turn_ids

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "locomo"
needs_data = pytest.mark.skipif(not DATA.is_dir(), reason="LoCoMo data not found: put LoCoMo's conversations, one JSON file each (conv-26.json, ...: the entries of data/locomo10.json at github.com/snap-research/locomo), in ../shared/data/locomo beside the checkout")
sys.path.insert(0, str(ROOT / "benchmarks"))
import locomo_accuracy as harness  # noqa: E402


def test_turn_references_in_every_released_shape():
    assert turn_ids("D3:4") == ["D3:4"]
    assert turn_ids(["D15:3", "D15:5"]) == ["D15:3", "D15:5"]
    assert turn_ids("D22:10, D22:12") == ["D22:10", "D22:12"]
    assert turn_ids("D8:6; D9:17") == ["D8:6", "D9:17"]
    assert turn_ids("D:11:26") == ["D11:26"]
    assert turn_ids("D") == []


@needs_data
def test_every_conversation_loads_whole():
    convs = load_all(DATA)
    assert len(convs) == 7
    questions = [q for c in convs for q in c.questions]
    assert len(questions) == 1035  # every category-1-4 question, none dropped
    assert Counter(q.category for q in questions) == {4: 563, 2: 214, 1: 192, 3: 66}
    assert sum(len(c.all_facts()) for c in convs) == 1755
    for conv in convs:
        order = {t.turn_id: i for i, t in enumerate(conv.turns)}
        for text, source in conv.all_facts():
            assert source in order
            cited = conv.cited[text]
            assert source in cited and all(order[c] <= order[source] for c in cited)  # the latest cited turn
        assert all(set(q.evidence) <= set(order) for q in conv.questions)


@needs_data
def test_a_fact_citing_several_turns_is_stored_after_the_latest():
    conv = load_conversation(DATA / "conv-44.json")  # cites lists and a "D26:14, D26:34, D26:42" string
    order = {t.turn_id: i for i, t in enumerate(conv.turns)}
    several = {text: source for text, source in conv.all_facts() if len(conv.cited[text]) > 1}
    assert len(several) >= 4
    for text, source in several.items():
        assert source == max(conv.cited[text], key=order.__getitem__)
    assert any(conv.cited[text] == ("D26:14", "D26:34", "D26:42") for text in several)


def test_stratified_sample_is_seeded_and_proportional():
    items = [("a", i) for i in range(60)] + [("b", i) for i in range(30)] + [("c", i) for i in range(10)]
    first = stratified_sample(items, 20, key=lambda x: x[0], seed=3)
    assert first == stratified_sample(items, 20, key=lambda x: x[0], seed=3)
    assert first != stratified_sample(items, 20, key=lambda x: x[0], seed=4)
    assert Counter(x[0] for x in first) == {"a": 12, "b": 6, "c": 2}
    assert first == sorted(first, key=items.index)  # original order kept
    assert stratified_sample(items, 500, key=lambda x: x[0]) == items


def test_scores():
    assert harness.f1("Pixel", "pixel") == 1.0
    assert harness.f1("The cat is called Pixel.", "Pixel") == pytest.approx(2 * (1 / 4) / (1 + 1 / 4))
    assert harness.f1("", "Pixel") == 0.0
    assert harness.contains("She lives in Costa da Caparica.", "Costa da Caparica") == 1.0
    assert harness.contains("She lives in Costa.", "Costa da Caparica") == 0.0
    assert harness.recall(("D1:1", "D1:2"), {"D1:2", "D5:5"}) == 0.5
    assert harness.recall((), {"D1:2"}) is None


def test_methods_are_named_by_what_they_change():
    grid = harness.method_sets()["grid"]
    names = [m.name for m in grid]
    assert len(names) == len(set(names))
    assert {"prompt", "kv", "kv[window=-5,closing=answer,recompute_tokens=256]"} <= set(names)
    assert harness.select_methods("prompt;kv")[1] == harness.Method("kv")
    with pytest.raises(SystemExit, match="unknown field 'nope'"):
        harness.select_methods("kv[nope]")
    with pytest.raises(SystemExit, match="unknown method"):
        harness.select_methods("kvv")
    parsed = harness.select_methods("kv[window=-10,closing=answer,key_scale=1.5];prompt[order=stored]")
    assert parsed[0] == harness.Method("kv[window=-10,closing=answer,key_scale=1.5]", window=-10, closing="answer",
                                       key_scale=1.5)
    assert parsed[1].mode == "prompt" and parsed[1].order == "stored"


def test_segment_order_follows_the_composer():
    retrieved = [7, 2, 9, 4]  # best first
    assert harness.segment_order(retrieved, "relevance") == [4, 9, 2, 7]  # the most relevant last
    assert harness.segment_order(retrieved, "stored") == [2, 4, 7, 9]
    with pytest.raises(ValueError, match="unknown composer order"):
        harness.segment_order(retrieved, "random")
    stored = {m.name: m for m in harness.method_sets()["order"]}["kv[window=-5,closing=answer,order=stored]"]
    assert stored.order == "stored" and stored.encoding == (-5, "bullet", 0, 1.0)


def test_slot_methods_read_the_window_nearest_each_slot():
    slots = {m.name: m for m in harness.method_sets()["tradeoff"]}["kv[slots=0/5/20,closing=answer]"]
    assert slots.encodings == [(0, "bullet", 0, 1.0), (-5, "bullet", 0, 1.0), (-20, "bullet", 0, 1.0)]
    assert [slots.encoding_at(j)[0] for j in (0, 2, 3, 7, 12, 13, 49)] == [0, 0, -5, -5, -5, -20, -20]
    # every facts window shares one user, its fact ids told apart by the window
    assert len({harness.user_of("c", e) for e in slots.encodings}) == 1
    assert len({harness.source_tag(e, "D1:3") for e in slots.encodings}) == 3
    plain = harness.Method("kv", window=-5)
    assert plain.encodings == [plain.encoding] and plain.encoding_at(9) == plain.encoding


def test_the_offline_set_is_the_calibrated_and_depth_sets_in_one_run():
    sets = harness.method_sets()
    names = [m.name for m in sets["offline"]]
    assert len(names) == len(set(names)) and names[: len(sets["calibrated"])] == [m.name for m in sets["calibrated"]]
    assert set(names) == {m.name for m in sets["calibrated"] + sets["depth"]}


def test_each_fact_reads_the_encoding_whose_context_holds_more_of_the_retrieved():
    mixed = {m.name: m for m in harness.method_sets()["depth"]}["kv[contexts=f10/n10,closing=answer]"]
    assert mixed.encodings == [(-10, "bullet", 0, 1.0), (0, "bullet", 10, 1.0)]
    # both encodings under one user, their fact ids told apart, so one request reads both
    assert len({harness.user_of("c", e) for e in mixed.encodings}) == 1
    assert len({harness.source_tag(e, "D1:3") for e in mixed.encodings}) == 2
    ranks = {"c": [[j + 20 + i for i in range(20)] for j in range(60)]}  # fact j's nearest: j+20, j+21, ...
    contexts = harness.Contexts(ranks)
    assert contexts.context("c", 12, mixed.encodings[0]) == set(range(2, 12))
    assert contexts.context("c", 3, mixed.encodings[0]) == {0, 1, 2}
    assert contexts.context("c", 12, mixed.encodings[1]) == set(range(32, 42))
    stored_before, nearest = mixed.encodings
    assert contexts.choose(mixed, "c", 12, {12, 3, 4, 5, 33}) == stored_before
    assert contexts.choose(mixed, "c", 12, {12, 3, 33, 34}) == nearest
    assert contexts.choose(mixed, "c", 12, {12, 3, 33}) == stored_before  # a tie: the first listed
    assert contexts.choose(mixed, "c", 12, {12}) == stored_before
    with pytest.raises(ValueError, match="unknown context"):
        harness.context_encoding("x5", "bullet", 1.0)


def test_content_scale_leaves_the_key_bias_alone():
    """b + c (k - b): the bias term of every logit (positional, the same with and without the
    scale) is kept; without a bias the whole key is scaled. Each scale is its own user."""
    import torch
    from transformers import AutoModelForCausalLM

    from inferscale.encode.capture import attention_modules, key_biases
    from inferscale.kv import FactKV

    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_models.tiny_model_dir("qwen2", "float32"))
    heads, size = qwen2.config.num_key_value_heads, qwen2.config.hidden_size // qwen2.config.num_attention_heads
    biases = key_biases(attention_modules(qwen2), heads, size)
    keys = torch.randn(len(biases), 3, heads, size)
    kv = FactKV((1, 2, 3), keys, torch.randn_like(keys))
    scaled = harness.content_scaled(kv, biases, 1.5)
    for layer, b in enumerate(biases):
        torch.testing.assert_close(scaled.keys[layer] - b, 1.5 * (keys[layer] - b))
    torch.testing.assert_close(harness.content_scaled(kv, torch.zeros_like(biases), 1.5).keys, 1.5 * keys)
    assert scaled.values is kv.values and scaled.token_ids == kv.token_ids
    plain, warm = harness.Method("kv", window=-5), harness.Method("kv", window=-5, content_scale=1.1)
    assert harness.user_of("c", plain.encoding) != harness.user_of("c", warm.encoding)


def test_a_calibration_is_an_encoding_of_its_own(tmp_path):
    """A method reading a calibration file stores its facts under users of their own (the
    correction itself is tested in tests/test_calibration.py)."""
    path = tmp_path / "calibration.json"
    cal = harness.Method("kv", window=-10, calibration=str(path))
    assert cal.encoding[3] == str(path) and harness.user_of("c", cal.encoding) != harness.user_of("c", harness.Method("kv", window=-10).encoding)
    plain, prompt = harness.Method("kv", window=-10), harness.Method("prompt", mode="prompt")
    encodings = harness.kv_encodings([cal, plain, prompt, plain])  # a scale and a path in one list
    assert sorted(encodings, key=str) == sorted([cal.encoding, plain.encoding], key=str)
    assert harness.kv_encodings([plain, cal]) == encodings  # whatever the methods' order


@needs_data
def test_harness_runs_on_every_conversation(tmp_path):
    """A stratified sample across all 7 conversations, on a tiny model: every method answers every
    question, nothing falls back, the tail budget recomputes and the files are written."""
    model = tiny_models.tiny_model_dir("qwen2", "float32")
    out = tmp_path / "locomo.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "locomo_accuracy.py"), "--data", str(DATA), "--model", str(model),
         "--sample", "14", "--ks", "2,4", "--methods", "smoke", "--max-tokens", "4",
         "--retrieval", str(ROOT / "benchmarks" / "results" / "locomo_retrieval_minilm.json"),
         "--related", str(ROOT / "benchmarks" / "results" / "locomo_related_minilm.json"), "--out", str(out)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["questions"] == 14 and len(result["conversations"]) == 7
    summary = result["summary"]
    assert set(summary) == {m.name for m in harness.method_sets()["smoke"]}
    for name, per_k in summary.items():
        assert set(per_k) == {"2", "4"}
        assert all(cell["fallbacks"] == 0 for cell in per_k.values()), name
    assert summary["kv[window=-5,recompute_tokens=64]"]["4"]["recomputed"] > 0
    assert summary["kv"]["4"]["recomputed"] == 0 and summary["kv"]["4"]["injected"] > 0
    assert out.with_suffix(".md").exists() and out.with_name("locomo_answers.json.gz").exists()


def test_gaps_are_paired_per_question_with_an_interval_around_the_mean(tmp_path):
    import gzip
    import importlib.util

    spec = importlib.util.spec_from_file_location("locomo_gaps", ROOT / "benchmarks" / "locomo_gaps.py")
    gaps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gaps)
    questions = [{"conv": "c", "index": i, "category": 1 + i % 4} for i in range(40)]
    rows = [{"conv": "c", "q": i, "k": 5, "method": "prompt", "f1": (i % 7) / 7} for i in range(40)]
    rows += [{"conv": "c", "q": i, "k": 5, "method": "level", "f1": (i % 7) / 7 - 0.1} for i in range(40)]
    rows += [{"conv": "c", "q": i, "k": 5, "method": "mixed", "f1": float(i % 2)} for i in range(40)]
    path = tmp_path / "answers.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"questions": questions, "rows": rows}).encode()))
    out = {(r["method"], r["group"]): r for r in gaps.gaps(*gaps.load(path), baseline="prompt")}
    level = out[("level", "all")]  # the same difference on every question: the interval is that point
    assert level["questions"] == 40 and level["low"] == pytest.approx(-0.1) and level["high"] == pytest.approx(-0.1)
    assert out[("level", "multi-hop")]["questions"] == 10 and out[("level", "temporal")]["questions"] == 10
    mixed = out[("mixed", "all")]
    assert mixed["low"] < mixed["gap"] < mixed["high"]
    assert ("prompt", "all") not in out
    assert "| level | 5 | -0.100 (-0.100, -0.100) |" in gaps.markdown(list(out.values()), "prompt")


def test_misses_groups_questions_by_their_retrieved_evidence():
    import importlib.util

    spec = importlib.util.spec_from_file_location("locomo_misses", ROOT / "benchmarks" / "locomo_misses.py")
    misses = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(misses)
    assert misses.group_of([], 5) == "none" and misses.group_of([7], 5) == "one"
    assert misses.group_of([3, 7, 10], 5) == "near"  # 3-7 and 7-10 are within 5 of each other
    assert misses.group_of([3, 7, 30], 5) == "apart"  # no encoding of 30 saw 3 or 7, nor theirs it
    assert misses.window_of("kv[window=-10,closing=answer]") == 10 and misses.window_of("kv[slots=5/20]") == 5


def test_a_method_whose_calibration_does_not_load_is_skipped_by_name(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"key_scale": [[1.0]], "value_scale": [[1.0]]}))
    methods = [harness.Method("kv", window=-10), harness.Method("kv", window=-10, calibration=str(good)),
               harness.Method("kv", window=-10, calibration=str(tmp_path / "missing.json"))]
    assert harness.usable(methods) == methods[:2]
    assert "skipped kv: calibration" in capsys.readouterr().out


def test_the_ask_closing_asks_the_question_twice():
    """``closing=ask``: the closing line, then the question itself, before the user's turn that asks
    it again; the prefix and the facts stay those of every other method."""
    from transformers import AutoTokenizer

    from locomo.prompts import Prompts

    tokenizer = AutoTokenizer.from_pretrained(tiny_models.tiny_model_dir("qwen2", "float32"))
    prompts = Prompts(tokenizer, {})
    question = "When did Maya go surfing?"
    asked, answer = prompts.query("ask", question), prompts.query("answer", question)
    text = tokenizer.decode(asked)
    assert text.count(question) == 2 and tokenizer.decode(answer).count(question) == 1
    assert text.startswith(tokenizer.decode(prompts.query("answer", question))[:20])
    assert harness.select_methods("kv[window=-10,closing=ask]")[0].closing == "ask"
