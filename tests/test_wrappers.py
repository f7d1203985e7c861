"""Fact wrappers: their file (checked on load), their token ids, the encoder running them through
the model (the fact's own K/V untouched by a trailer, the wrapper K/V those of the vectors), and
the teacher-forced reads the screen and the trainer are built on."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.encode.wrappers import FactWrappers, embedding_slots
from inferscale.errors import ConfigError, ModelMismatchError

FILLER = 7


def _wrappers(header: int, trailer: int, hidden: int = 4, seed: int = 0) -> FactWrappers:
    gen = torch.Generator().manual_seed(seed)
    return FactWrappers(torch.randn(header, hidden, generator=gen), torch.randn(trailer, hidden, generator=gen), FILLER)


ids_st = st.lists(st.integers(10, 1000), min_size=1, max_size=12)


@settings(max_examples=80, deadline=None)
@given(ids_st, st.integers(0, 3), st.integers(0, 4))
def test_wrapped_ids_carry_the_filler_and_unwrap_to_the_fact(ids, header, trailer):
    if header + trailer == 0:
        with pytest.raises(ConfigError, match="no header and no trailer"):
            _wrappers(header, trailer)
        return
    w = _wrappers(header, trailer)
    marked = w.marked(ids)
    assert len(marked) == len(ids) + header + trailer
    assert [i for i in marked if i < 0] == [-1 - s for s in range(header + trailer)]
    stored = w.wrapped(ids)
    assert stored == w.stored(marked) and w.is_wrapped(stored)
    assert list(w.unwrapped(stored)) == ids
    assert list(w.unwrapped(ids)) == ids  # stored before wrappers were configured: left alone


def test_a_file_round_trips_and_is_checked(tmp_path, tiny_model_dirs):
    from inferscale.encode.weights import load_causal_lm

    model, _ = load_causal_lm(tiny_model_dirs["qwen2"])
    hidden = model.get_input_embeddings().weight.shape[1]
    w = _wrappers(1, 3, hidden)
    w.save(tmp_path / "w.safetensors")
    back = FactWrappers.load(tmp_path / "w.safetensors")
    assert torch.equal(back.header, w.header) and torch.equal(back.trailer, w.trailer) and back.filler_id == FILLER
    assert back.check(model) is back
    with pytest.raises(ModelMismatchError, match=f"hidden size {hidden + 1}"):
        _wrappers(0, 2, hidden + 1).check(model)
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 40)
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        FactWrappers.load(tmp_path / "junk.safetensors")
    with pytest.raises(ConfigError, match="not a readable"):
        FactWrappers.load(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"header": torch.zeros(0, 4)}, str(tmp_path / "other.safetensors"), metadata={"format": "x"})
    with pytest.raises(ConfigError, match="expected format"):
        FactWrappers.load(tmp_path / "other.safetensors")
    with pytest.raises(ConfigError, match="not finite"):
        FactWrappers(torch.full((1, 4), float("nan")), torch.zeros(1, 4), FILLER)


def test_marked_ids_embed_as_the_vectors_and_gradients_reach_them(tiny_model_dirs):
    from inferscale.encode.weights import load_causal_lm

    model, _ = load_causal_lm(tiny_model_dirs["qwen2"])
    embedding = model.get_input_embeddings()
    table = torch.nn.Parameter(torch.randn(3, embedding.weight.shape[1]))
    ids = torch.tensor([[5, -1, 9, -3, -2]])
    with embedding_slots(model, table):
        out = embedding(ids)
    assert torch.equal(out[0, 0], embedding.weight[5]) and torch.equal(out[0, 2], embedding.weight[9])
    assert torch.equal(out[0, 1], table[0]) and torch.equal(out[0, 3], table[2]) and torch.equal(out[0, 4], table[1])
    out.sum().backward()
    assert table.grad is not None and bool((table.grad != 0).all())
    assert torch.equal(embedding(torch.tensor([[5]]))[0, 0], embedding.weight[5])  # the hooks are gone


@pytest.mark.parametrize("share", [False, True])
def test_the_encoder_wraps_facts_and_a_trailer_leaves_their_own_kv_alone(tiny_model_dirs, share):
    from inferscale.encode import FactEncoder, FactsWindow
    from inferscale.encode.capture import KVCapture, attention_modules
    from inferscale.encode.weights import load_causal_lm
    from inferscale.facts import Fact

    model, tokenizer = load_causal_lm(tiny_model_dirs["qwen2"])
    hidden = model.get_input_embeddings().weight.shape[1]
    window = FactsWindow(FactsWindow.Options(window=2))
    trailer = _wrappers(0, 3, hidden, seed=1)
    plain = FactEncoder(model, tokenizer, window, batch_size=1, share_prefixes=share)
    wrapped = FactEncoder(model, tokenizer, window, batch_size=1, share_prefixes=share, wrappers=trailer)
    facts = [Fact(f"f{i}", "u", text) for i, text in enumerate(["Ana lives in Lima.", "Bo has two dogs.", "Cy sings."])]
    prefix = tokenizer.encode("Facts:\n", add_special_tokens=False)
    a, b = plain.encode(facts, progress=False, prefix_ids=prefix), wrapped.encode(facts, progress=False, prefix_ids=prefix)
    for fid, kv in a.items():
        n = kv.num_tokens
        assert b[fid].token_ids == trailer.wrapped(kv.token_ids)
        torch.testing.assert_close(b[fid].keys[:, :n], kv.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b[fid].values[:, :n], kv.values, rtol=1e-5, atol=1e-5)
    # the trailer's K/V are the model's over the vectors, read after the fact's row
    last = facts[2]
    context = prefix + [t for f in facts[:2] for t in a[f.fact_id].token_ids] + list(a[last.fact_id].token_ids)
    embeds = torch.cat([model.get_input_embeddings()(torch.tensor([context]))[0], trailer.trailer.to(model.dtype)])
    capture = KVCapture(attention_modules(model), wrapped.num_kv_heads, wrapped.head_size)
    capture.seq = embeds.shape[0]
    with capture, torch.no_grad():
        model.model(inputs_embeds=embeds[None])
    want_keys = torch.stack([k[0, -3:] for k in capture.keys])
    torch.testing.assert_close(b[last.fact_id].keys[:, -3:], want_keys, rtol=1e-4, atol=1e-4)
    # a header sits in the fact's context, so it changes the fact's own K/V
    header = FactEncoder(model, tokenizer, window, batch_size=1, wrappers=_wrappers(2, 1, hidden, seed=2))
    c = header.encode(facts, progress=False, prefix_ids=prefix)
    assert c[last.fact_id].token_ids[:2] == (FILLER, FILLER)
    assert not torch.allclose(c[last.fact_id].keys[:, 2:-1], a[last.fact_id].keys)


def test_the_student_reads_stored_kv_as_the_teacher_reads_the_same_text(tiny_model_dirs):
    """With every fact encoded behind all the facts before it and read in that order, the stored
    K/V are the text's own: KL ~ 0 and the same NLL; relocated from another window they differ."""
    from inferscale.compose.rope import RotaryEmbedding
    from inferscale.encode import FactEncoder, FactsWindow, distill
    from inferscale.encode.weights import load_causal_lm
    from inferscale.facts import Fact

    model, tokenizer = load_causal_lm(tiny_model_dirs["qwen2"])
    rope = RotaryEmbedding.from_hf_config(model.config)
    facts = [Fact(f"f{i}", "u", t) for i, t in enumerate(["Ana lives in Lima.", "Bo has two dogs.", "Cy sings.", "Di runs."])]
    prefix = tokenizer.encode("Facts:\n", add_special_tokens=False)
    query, gold = tokenizer.encode("Who sings?\n", add_special_tokens=False), tokenizer.encode("Cy", add_special_tokens=False)
    results = {}
    for window in (10, 0):
        encoder = FactEncoder(model, tokenizer, FactsWindow(FactsWindow.Options(window=window)) if window else None,
                              batch_size=1)
        kvs = encoder.encode(facts, progress=False, prefix_ids=prefix)
        parts = [encoder.encode_ids(prefix), *(kvs[f.fact_id] for f in facts)]
        keys, values = (torch.cat([getattr(p, name) for p in parts], dim=1) for name in ("keys", "values"))
        text = [t for p in parts for t in p.token_ids]
        with torch.no_grad():
            teacher = distill.text_logprobs(model, text + query + gold, len(gold))
            cache = distill.segment_cache(model, rope, keys, values)
            student = distill.cached_logprobs(model, cache, keys.shape[1], query + gold, len(gold))
        results[window] = (distill.kl_per_token(teacher, student), distill.nll_per_token(student, gold),
                           distill.nll_per_token(teacher, gold))
    kl, nll, teacher_nll = results[10]
    assert float(kl.abs().max()) < 1e-4
    torch.testing.assert_close(nll, teacher_nll, rtol=1e-4, atol=1e-4)
    assert float(results[0][0].mean()) > 100 * max(float(kl.abs().max()), 1e-7)


def test_the_memory_side_wraps_stored_facts_and_prompt_injection_reads_them_plain(tiny_model_dirs, tmp_path):
    from inferscale.api import Context, GenerationAPI, MemoryAPI
    from inferscale.config import Config

    model = str(tiny_model_dirs["qwen2"])
    with pytest.raises(ConfigError, match="wrappers must be a string"):
        Config.from_dict({"wrappers": 3})
    (tmp_path / "bad.safetensors").write_text("no")
    with pytest.raises(ConfigError, match="not a readable"):
        MemoryAPI(Context(Config.from_dict({"model": model, "data_dir": str(tmp_path / "a"),
                                            "wrappers": str(tmp_path / "bad.safetensors")})))
    plain = MemoryAPI(Context(Config.from_dict({"model": model, "data_dir": str(tmp_path / "b")})))
    hidden = plain.encoder.model.get_input_embeddings().weight.shape[1]
    filler = plain.context.tokenizer.encode(" ", add_special_tokens=False)[-1]
    w = FactWrappers(torch.zeros(0, hidden), torch.randn(2, hidden), filler)
    w.save(tmp_path / "w.safetensors")
    config = Config.from_dict({"model": model, "data_dir": str(tmp_path / "c"), "wrappers": str(tmp_path / "w.safetensors")})
    context = Context(config)
    memory = MemoryAPI(context)
    facts = ["Ann has a cat named Miso.", "Ann runs on Sundays."]
    memory.add_facts("ann", facts, progress=False)
    plain.add_facts("ann", facts, progress=False)
    stored = {f.text: f.token_ids for f in memory.list_facts("ann")}
    own = {f.text: f.token_ids for f in plain.list_facts("ann")}
    for text in facts:
        assert stored[text] == own[text] + (filler, filler)
    generation = GenerationAPI(context)
    order = [f.fact_id for f in memory.list_facts("ann")]
    kv = generation.prompt("ann", "What is the cat called?", order, mode="kv").prompt["prompt_token_ids"]
    text = generation.prompt("ann", "What is the cat called?", order, mode="prompt").prompt["prompt_token_ids"]
    assert len(kv) == len(text) + 2 * len(facts)
    assert [t for t in kv if t != filler] == [t for t in text if t != filler]
    memory.close(), plain.close()
