"""benchmarks/fact_corpus.py without a model: cleaning the model's lines, templates, recombination, dedup."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus():
    spec = importlib.util.spec_from_file_location("fact_corpus", REPO / "benchmarks" / "fact_corpus.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_model_lines_become_facts_naming_the_person(corpus):
    maya = corpus.Person("Maya Silva", 31, "nurse", "Porto")
    text = ("Here are the facts:\n1. Maya Silva's sister lives in Porto.\n- Maya started surfing in May 2023\n"
            "• Her cat is grey.\n2) \"Maya dislikes olives.\"\nMayan ruins fascinate everyone here today.")
    assert corpus.parse_facts(text, maya) == ["Maya Silva's sister lives in Porto.",
                                              "Maya started surfing in May 2023.", "Maya dislikes olives."]
    paragraph = "Maya lives in Porto, near the river. She is a nurse. Maya's brother Liam moved to Oslo in 2021."
    assert corpus.parse_facts(paragraph, maya) == ["Maya lives in Porto, near the river.",
                                                   "Maya's brother Liam moved to Oslo in 2021."]


def test_saved_answers_become_facts_and_templates(corpus):
    record = {"person": {"name": "Maya Silva", "age": 31, "job": "nurse", "home": "Porto"},
              "text": "1. Maya Silva was born in Lisbon.\n2. Maya likes tea. Maya likes tea!"}
    generated, templates = corpus.from_records([record])
    assert generated == ["Maya Silva was born in Lisbon.", "Maya likes tea."]
    assert templates == ["{name} was born in {place}.", "{first} likes tea.", "{first} likes tea!"]


def test_a_fact_becomes_a_template_for_anyone(corpus):
    maya, liam = corpus.Person("Maya Silva", 31, "nurse", "Porto"), corpus.Person("Liam Berg", 40, "chef", "Oslo")
    template = corpus.to_template("Maya Silva's sister lives in Porto; Maya visits {often}.", maya)
    assert template == "{name}'s sister lives in {place}; {first} visits {{often}}."
    filled = corpus.fill(template, liam, pick=7)
    assert filled.startswith("Liam Berg's sister lives in ") and filled.endswith("; Liam visits {often}.")
    assert filled[len("Liam Berg's sister lives in "):].split(";")[0] in corpus.PLACES
    assert corpus.fill(template, liam, pick=7) == filled  # the pick fixes the slots
    assert corpus.to_template("Her sister lives in Porto.", maya) is None


@pytest.mark.parametrize("n_templates, n_people", [(1, 1), (3, 4), (7, 5), (12, 12)])
def test_pair_order_visits_every_pair_once(corpus, n_templates, n_people):
    pairs = list(corpus.pair_order(n_templates, n_people, seed=3))
    assert sorted(pairs) == [(t, p) for t in range(n_templates) for p in range(n_people)]


def test_recombination_reaches_the_target_without_duplicates(corpus):
    people = corpus.make_people(40, seed=0)
    generated = ["Maya Silva likes tea.", "maya silva likes tea!", "Liam Berg was born in Oslo."]
    facts = corpus.recombine(generated, corpus.TEMPLATES, people, 500, seed=1)
    assert len(facts) == 500 and facts[:2] == ["Maya Silva likes tea.", "Liam Berg was born in Oslo."]
    assert len({corpus.normalise(f) for f in facts}) == 500
    assert len({f.split()[0].split("'")[0] for f in facts[2:]}) > 20  # many people
    assert corpus.recombine(generated, corpus.TEMPLATES, people, 500, seed=1) == facts
    assert corpus.recombine(generated, corpus.TEMPLATES, people, 500, seed=2) != facts
    visits = corpus.recombine([], ["{first} visited {place}."], people[:2], 12, seed=0)  # passes fill slots anew
    assert len(set(visits)) == 12 and {v.split()[0] for v in visits} == {p.first for p in people[:2]}
    with pytest.raises(ValueError, match="2 templates × 3 people give 6 distinct facts, fewer than 7"):
        corpus.recombine([], ["{first} likes tea.", "{name} likes tea."], people[:3], 7, seed=0)


def test_template_only_corpus_is_written_and_embedded(corpus, tmp_path):
    corpus.main(["--facts", "60", "--templates-only", "--out", str(tmp_path / "c")])
    facts = (tmp_path / "c" / "facts.txt").read_text().splitlines()
    vectors = np.load(tmp_path / "c" / "vectors.npy")
    summary = json.loads((tmp_path / "c" / "corpus.json").read_text())
    assert len(facts) == 60 == len(set(facts)) and vectors.shape == (60, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert summary["facts"] == 60 and summary["generated"] == 0 and summary["dim"] == 384
    with pytest.raises(SystemExit, match="inside the repository"):
        corpus.main(["--facts", "5", "--templates-only", "--no-embed", "--out", str(REPO / "corpus")])
