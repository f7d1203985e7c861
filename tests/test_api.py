"""The facade end to end on a tiny model: build memory, answer with KV injection,
with prompt injection and without memory; memory survives a restart."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch

import vllm_harness
from inferscale import MissingFactError, UnknownUserError
from inferscale.api import Context, InferScale, MemoryAPI, PromptRequest
from inferscale.datasets.demo import FACTS, TURNS, USER

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mem(tmp_path_factory):
    """The facade engine shared with test_api_isolation.py (vllm_harness.facade)."""
    api = vllm_harness.facade(tmp_path_factory)
    api.add_conversation(USER, TURNS, FACTS, progress=False)
    return api


def test_kv_injection_prefills_only_the_question(mem):
    answer = mem.generate(USER, "What is the name of my cat?", k=5, max_tokens=4)
    assert answer.fallback is None
    assert len(answer.fact_ids) == 5
    # the CPU default recomputes at most 16 tokens of whole facts at the tail; the rest is injected
    assert answer.injected_tokens + answer.recomputed_tokens == answer.memory_tokens
    assert answer.injected_tokens > 0 and 0 <= answer.recomputed_tokens <= 16
    assert answer.prompt_tokens > answer.memory_tokens
    assert {"retrieval", "compose", "engine_ttft", "total", "query_to_first_token"} <= set(answer.timings)
    assert not math.isnan(answer.timings["engine_ttft"])


def test_prompt_injection_uses_the_same_tokens(mem):
    kv = mem.generate(USER, "Where does my sister live?", k=4, max_tokens=4)
    text = mem.generate(USER, "Where does my sister live?", k=4, mode="prompt", max_tokens=4)
    assert text.fact_ids == kv.fact_ids and text.prompt_tokens == kv.prompt_tokens
    assert text.injected_tokens == 0 and text.fallback is None
    none = mem.generate(USER, "Where does my sister live?", mode="none", max_tokens=4)
    assert none.fact_ids == [] and none.memory_tokens == 0


def test_recompute_budget_per_request(mem):
    question = "What am I allergic to?"
    injected = mem.generate(USER, question, k=4, max_tokens=6, recompute_tokens=0)
    assert injected.injected_tokens == injected.memory_tokens and injected.recomputed_tokens == 0
    everything = mem.generate(USER, question, k=4, max_tokens=6, recompute_tokens=10_000)
    text = mem.generate(USER, question, k=4, max_tokens=6, mode="prompt")
    assert everything.recomputed_tokens == everything.memory_tokens - len(mem.prefix_ids)
    assert everything.injected_tokens in (0, len(mem.prefix_ids))  # the prefix may already be in vLLM's cache
    assert everything.text == text.text  # only the exact prefix reused: prompt injection's answer


def test_at_most_five_facts_per_turn(mem):
    facts = [(f"Fact number {i} about the weather.", "D1:2") for i in range(8)]
    stored = mem.add_conversation("lee", TURNS, facts, progress=False)
    assert len(stored) == 5


def test_unknown_user_is_a_clear_error(mem):
    with pytest.raises(UnknownUserError, match="nobody"):
        mem.generate("nobody", "Hi?")


def test_memory_survives_a_restart(mem):
    """Everything is read back from the disk store alone: facts, embeddings, the index."""
    again = InferScale(mem.config)
    assert again.context.retriever.count(USER) == len(FACTS)
    assert again.memory.list_facts(USER) == mem.memory.list_facts(USER)
    hits = again.generation.retrieve(USER, "What is the name of my cat?", k=3)
    assert hits == mem.generation.retrieve(USER, "What is the name of my cat?", k=3)
    # the memory side alone, as a server process would run it
    assert MemoryAPI(Context(mem.config)).list_facts(USER) == mem.memory.list_facts(USER)


def test_memory_side_lists_searches_updates_and_deletes(mem):
    memory = mem.memory
    facts = memory.list_facts("ivy") if "ivy" in memory.users() else \
        memory.add_facts("ivy", [(text, turn) for text, turn in FACTS])
    assert [f.text for f in memory.list_facts("ivy")] == [text for text, _ in FACTS]
    found = memory.search("ivy", "What is the name of my cat?", k=3)
    assert len(found) == 3 and found[0].score >= found[-1].score and all(f.fact.text for f in found)
    cat = next(f for f in facts if "cat" in f.text)
    encoder = memory.encoder
    new = memory.update_fact("ivy", cat.fact_id, "Ivy has a grey cat called Pixel, aged eight.")
    assert memory.encoder is encoder  # the model is loaded once and kept
    ids = [f.fact_id for f in memory.list_facts("ivy")]
    assert cat.fact_id not in ids and new.fact_id in ids and len(ids) == len(FACTS)
    answer = mem.generate("ivy", "What is the name of my cat?", k=len(FACTS), max_tokens=2)
    assert answer.fallback is None and new.fact_id in answer.fact_ids and cat.fact_id not in answer.fact_ids
    memory.delete_fact("ivy", new.fact_id)
    assert new.fact_id not in [f.fact_id for f in memory.list_facts("ivy")]
    with pytest.raises(MissingFactError):
        memory.delete_fact("ivy", new.fact_id)
    assert "ivy" in memory.users()
    # what Mem0 kept of ivy with InferScale as its vector store goes too
    from inferscale.mem0.collection_files import CollectionFiles, UserMemories

    mem0_files = CollectionFiles(memory.config.mem0_path / "vectors" / "mem0")
    mem0_files.save(UserMemories("ivy", ["m1"], torch.zeros(1, 4), [{"data": "Ivy has a cat."}]))
    kv = memory.config.kv_path / "users" / "ivy"  # the user's index and K/V segments
    assert (kv / "index.json").is_file()
    gone = memory.delete_user("ivy")
    assert "ivy" not in memory.users() and not mem0_files.path("ivy").exists() and gone.mem0_memories == 1
    assert not kv.exists()
    with pytest.raises(UnknownUserError):
        memory.list_facts("ivy")  # as search and generate answer
    with pytest.raises(UnknownUserError):
        mem.generate("ivy", "What is the name of my cat?")


def test_an_update_cut_short_anywhere_leaves_the_old_fact_or_the_new_one(mem, monkeypatch):
    """An update stores the new fact and removes the old one in one write: failing it at each of
    its fsyncs in turn (as a crash would stop it) leaves one version, never both."""
    real_fsync, before = os.fsync, ["Uma keeps bees.", "Uma rows on Sundays."]
    after = ["Uma keeps wasps.", "Uma rows on Sundays."]
    for crash_at in itertools.count(1):
        user = f"uma-{crash_at}"
        old = mem.memory.add_facts(user, before)
        calls = iter(range(1, 10**6))

        def fsync(fd):
            if next(calls) == crash_at:
                raise OSError("injected: the process stops here")
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        try:
            mem.memory.update_fact(user, old[0].fact_id, after[0])
            done = True
        except OSError:
            done = False
        monkeypatch.setattr(os, "fsync", real_fsync)
        stored = sorted(f.text for f in MemoryAPI(Context(mem.config)).list_facts(user))
        assert stored in (sorted(before), sorted(after)), crash_at
        if done:
            break
    assert crash_at > 3  # the update got as far as its commit and beyond


def test_facts_stored_without_text_are_stored_again_whole(mem, tmp_path):
    """Memory written before facts carried their text and embedding (format 1) is
    re-encoded and completed when its conversation is added again."""
    from inferscale.api import Context, MemoryAPI
    from inferscale.config import Config

    config = Config.from_dict({**mem.config.to_dict(), "data_dir": str(tmp_path)})
    memory = MemoryAPI(Context(config))
    stored = memory.add_facts("old", FACTS[:3])
    disk = memory.context.record
    disk.put("old", disk.load_user("old"))  # K/V and token ids only, as format 1 kept them
    assert [f.text for f in disk.facts("old").values()] == ["", "", ""] and disk.embeddings("old")[0] == []
    again = MemoryAPI(Context(config)).add_facts("old", FACTS[:3])
    assert again == stored and [f.text for f in disk.facts("old").values()] == [t for t, _ in FACTS[:3]]
    assert disk.embeddings("old")[0] == [f.fact_id for f in stored]
    memory.close()


def test_prompt_is_a_typed_request(mem):
    hits = mem.generation.retrieve(USER, "Where do I go surfing?", k=3)
    request = mem.generation.prompt(USER, "Where do I go surfing?", [h.fact_id for h in hits])
    assert isinstance(request, PromptRequest) and request.fact_ids == [h.fact_id for h in hits]
    assert request.kv_transfer_params["inferscale"]["fact_ids"] == request.fact_ids
    assert request.prompt["prompt_token_ids"][: len(mem.prefix_ids)] == mem.prefix_ids
    assert request.memory_tokens < request.num_tokens
