"""benchmarks/train_wrappers.py end to end on a tiny model: recall samples (nothing generated),
held-out KL measured during training, and the vectors of the lowest held-out KL kept."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from inferscale.encode import distill

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import train_wrappers  # noqa: E402

FACTS = [f"{name} {what}." for name in ("Ana", "Bruno", "Carla", "Dmitri", "Elif", "Femi")
         for what in ("moved to Lima in 2019", "keeps two dogs", "sings in a choir", "runs every Sunday")]


def test_recall_questions_read_the_fact_as_the_answer(tiny_model_dirs):
    model, tokenizer, _, _ = distill.frozen_model(str(tiny_model_dirs["qwen2"]))
    args = train_wrappers.parse_args(["--model", "x", "--facts", "x", "--out", "x.safetensors", "--questions", "recall",
                                      "--trailer", "2", "--window", "2", "--samples-per-user", "3", "--k", "2"])
    trainer = train_wrappers.Trainer(model, tokenizer, args, "cpu")
    users = [FACTS[:4]]
    samples = train_wrappers.make_samples(trainer, users, [trainer.encode_user(users[0])], 0,
                                          random.Random(0))
    assert len(samples) == 3
    for sample in samples:
        answer = sample.query[-sample.answer:]
        text = tokenizer.decode(answer[:-1]).strip()
        assert text in users[0], text  # the answer is one of the facts the sample reads, as written
        assert users[0].index(text) in sample.read
        assert len(sample.read) == 2 and sample.top_ids.shape[0] == sample.answer


def test_training_keeps_the_vectors_of_the_lowest_held_out_kl(tiny_model_dirs, tmp_path):
    facts = tmp_path / "facts.txt"
    facts.write_text("\n".join(FACTS) + "\n")
    out = tmp_path / "w.safetensors"
    train_wrappers.main(["--model", str(tiny_model_dirs["qwen2"]), "--facts", str(facts), "--questions", "recall",
                         "--header", "1", "--trailer", "2", "--window", "2", "--users", "2", "--held-out", "1",
                         "--facts-per-user", "4", "--samples-per-user", "2", "--k", "2,3", "--steps", "6",
                         "--eval-every", "2", "--teacher-top", "16", "--out", str(out)])
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["questions"] == "recall" and report["steps"] == 6
    assert [step for step, _ in report["held_out_curve"]] == [2, 4, 6]
    measured = [report["kl_initial"]["held_out"]] + [kl for _, kl in report["held_out_curve"]]
    assert all(math.isfinite(kl) for kl in measured)
    best = min(measured)
    assert report["kept_step"] == [0, 2, 4, 6][measured.index(best)]
    assert report["kl_after"]["held_out"] == pytest.approx(best, rel=1e-4, abs=1e-6)

    from inferscale.encode.wrappers import FactWrappers

    wrappers = FactWrappers.load(out)
    assert wrappers.header.shape[0] == 1 and wrappers.trailer.shape[0] == 2
