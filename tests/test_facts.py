"""Fact records, stable ids, and the fact catalog on disk."""

import pytest
import torch

from inferscale import CorruptDataError, Fact, make_fact_id
from inferscale.facts import render_fact
from inferscale.memory import FactCatalog


def test_fact_ids_are_stable_and_distinct():
    a = make_fact_id("ann", "Ann has a cat.", "D1:2")
    assert a == make_fact_id("ann", "Ann has a cat.", "D1:2")
    assert len({a, make_fact_id("bob", "Ann has a cat.", "D1:2"), make_fact_id("ann", "Ann has a cat.", "D1:3"),
                make_fact_id("ann", "Ann has a dog.", "D1:2")}) == 4


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "x" * 200, "sp ace", None, 3])
def test_ids_are_checked(bad):
    with pytest.raises(ValueError):
        Fact(bad, "ann", "text")
    with pytest.raises(ValueError):
        Fact("f-1", bad, "text")


def test_render_fact_is_one_bullet_line():
    assert render_fact("  Ann   has\na cat. ") == "- Ann has a cat.\n"


def test_catalog_round_trip_and_replace(tmp_path):
    catalog = FactCatalog(tmp_path)
    facts = [Fact("f-1", "ann", "Ann has a cat.", "D1:2", (5, 6)), Fact("f-2", "ann", "Ann runs.", None, (7,))]
    catalog.put("ann", facts, torch.eye(2, 3))
    assert catalog.facts("ann") == {f.fact_id: f for f in facts}
    ids, vectors = catalog.embeddings("ann")
    assert ids == ["f-1", "f-2"] and torch.equal(vectors, torch.eye(2, 3))
    catalog.put("ann", [Fact("f-2", "ann", "Ann runs fast.", None, (8,))], torch.ones(1, 3))
    assert catalog.facts("ann")["f-2"].text == "Ann runs fast." and len(catalog.facts("ann")) == 2
    assert catalog.users() == ["ann"]
    catalog.delete("ann")
    assert catalog.facts("ann") == {} and catalog.users() == []


def test_catalog_rejects_foreign_facts_and_bad_shapes(tmp_path):
    catalog = FactCatalog(tmp_path)
    with pytest.raises(ValueError, match="belongs to"):
        catalog.put("ann", [Fact("f-1", "bob", "x")], torch.ones(1, 3))
    with pytest.raises(ValueError, match="embeddings"):
        catalog.put("ann", [Fact("f-1", "ann", "x")], torch.ones(2, 3))


def test_corrupt_catalog_is_detected_and_left_alone(tmp_path):
    catalog = FactCatalog(tmp_path)
    catalog.put("ann", [Fact("f-1", "ann", "x")], torch.ones(1, 3))
    path = tmp_path / "ann.json"
    path.write_text(path.read_text()[:-20])
    with pytest.raises(CorruptDataError, match="ann.json"):
        catalog.facts("ann")
    with pytest.raises(CorruptDataError):  # a write never silently replaces unreadable data
        catalog.put("ann", [Fact("f-2", "ann", "y")], torch.ones(1, 3))
    assert path.exists()
