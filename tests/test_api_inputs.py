"""A new user's mistakes with the Python API get a clear error at the call that made them, before
any work (no encoder loaded, no engine started): a plain string as ``facts``, an empty or
blank fact (also through the server), ``k`` of 0, an unknown mode, a model that does not exist."""

from __future__ import annotations

import pytest

import tiny_models
from inferscale.api import InferScale
from inferscale.encode import Turn
from inferscale.errors import ConfigError
from inferscale.server.memory.schemas import AddMemories, UpdateMemory


@pytest.fixture
def mem(tmp_path):
    api = InferScale.from_config({"model": str(tiny_models.tiny_model_dir("qwen2", "float32")),
                                  "data_dir": str(tmp_path)})
    yield api
    assert "encoder" not in api.memory.__dict__ and api.generation._llm is None  # nothing heavy was started
    api.close()


def test_a_plain_string_as_facts_is_refused_not_stored_a_character_per_fact(mem):
    with pytest.raises(TypeError, match="a plain string: wrap it in a list"):
        mem.memory.add_facts("ann", "Ann has a cat.")
    with pytest.raises(TypeError, match="facts must be a list"):
        mem.add_conversation("ann", [Turn("t1", "Ann", "hi")], facts="Ann has a cat.")
    with pytest.raises(TypeError, match="string or a \\(text, turn_id\\) pair"):
        mem.memory.add_facts("ann", [("Ann has a cat.", "t1", "extra")])


@pytest.mark.parametrize("fact", ["", " ", "\n\t", ("  ", "t1")])
def test_an_empty_or_blank_fact_is_refused(mem, fact):
    with pytest.raises(ValueError, match="must hold some text"):
        mem.memory.add_facts("ann", [fact])


def test_the_server_refuses_blank_facts_too():
    for body in ({"user_id": "ann", "facts": ["  "]}, {"user_id": "ann", "facts": [{"text": "\n"}]}):
        with pytest.raises(ValueError, match="some text"):
            AddMemories.model_validate(body)
    with pytest.raises(ValueError, match="some text"):
        UpdateMemory.model_validate({"user_id": "ann", "text": " \t"})


@pytest.mark.parametrize("k", [0, -1, 1025, True, 2.0, "3"])
def test_k_must_be_a_positive_integer(mem, k):
    with pytest.raises(ValueError, match="k must be an integer in 1..1024"):
        mem.memory.search("ann", "pets", k=k)
    with pytest.raises(ValueError, match="k must be an integer"):
        mem.generation.retrieve("ann", "pets", k=k)
    with pytest.raises(ValueError, match="k must be an integer"):
        mem.generate("ann", "What is my cat called?", k=k)


@pytest.mark.parametrize("mode", ["text", "KV", "", None])
def test_an_unknown_mode_is_refused_before_the_engine_starts(mem, mode):
    with pytest.raises(ValueError, match="mode must be one of kv, prompt, none"):
        mem.generate("ann", "What is my cat called?", mode=mode)
    with pytest.raises(ValueError, match="mode must be one of"):
        mem.generation.prompt("ann", "What is my cat called?", [], mode=mode)


def test_a_model_that_does_not_exist_is_refused_at_once(tmp_path):
    with pytest.raises(ConfigError, match="not a known model"):
        InferScale.from_config({"model": "qwen2.5-coder-0.5b-instruc", "data_dir": str(tmp_path)})


def test_a_bad_user_id_is_refused_at_the_call(mem):
    with pytest.raises(ValueError, match="whitespace"):
        mem.memory.list_facts("ann smith")
