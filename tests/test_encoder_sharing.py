"""Shared prefills give the K/V of whole rows, and prefill each shared prefix once.

Exactness: for random facts, source turns, window policies, instruction
prefixes, batch sizes and ``only`` subsets, the shared path's K/V are compared
with whole rows prefilled one at a time (bit-identical to a plain forward,
tests/test_encoder.py) on the tiny Llama / Qwen2 / Qwen3 models in fp32: the
largest error of a layer over its largest |value| must stay <= 1e-5, ten
times tighter than padded batches of whole rows are held to. The splits of
the attention sums differ, so the results differ by fp32 rounding only
(measured <= 2e-6 relative); a fact encoded behind the wrong tokens or at the
wrong positions differs by order 1.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.encode import FactEncoder, FactsWindow, NoWindow, TokensWindow, TurnsWindow
from inferscale.encode.encoder import has_sliding_window
from inferscale.encode.sharing import Row, common_prefix_length, nest, plan
from inferscale.encode.weights import load_causal_lm
from inferscale.facts import Fact
from test_encoder import TURNS  # the same five LoCoMo-like turns

SHARE_REL_TOL = 1e-5

SENTENCES = [
    "Caroline attended an LGBTQ support group.",
    "Melanie painted a lake at sunrise.",
    "Caroline wants to adopt a child.",
    "Melanie runs a charity race.",
    "Caroline's sister is a nurse in Lisbon.",
    "The user prefers tea.",
    "Bob has two dogs.",
]
POLICIES = {
    "none": NoWindow(),
    "turns1": TurnsWindow(TurnsWindow.Options(window=1)),
    "turns2": TurnsWindow(TurnsWindow.Options(window=2)),
    "turns20": TurnsWindow(TurnsWindow.Options(window=20)),
    "tokens7": TokensWindow(TokensWindow.Options(max_tokens=7)),
    "tokens40": TokensWindow(TokensWindow.Options(max_tokens=40)),
    "tokens10k": TokensWindow(TokensWindow.Options(max_tokens=10_000)),
    "facts0": FactsWindow(FactsWindow.Options(window=0)),
    "facts2": FactsWindow(FactsWindow.Options(window=2)),
    "facts100": FactsWindow(FactsWindow.Options(window=100)),
}
PREFIXES = ["", "Facts:\n", "You are a helpful assistant. Answer from these facts about the user:\n"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tiny_model_dirs):
    model, tokenizer = load_causal_lm(tiny_model_dirs[request.param], dtype="float32")
    return request.param, model, tokenizer


def make_facts(per_turn: list[int], unsourced: int, texts: list[int]) -> list[Fact]:
    """``per_turn[i]`` facts citing turn i, then ``unsourced`` facts with no source turn."""
    sources = [TURNS[i].turn_id for i, n in enumerate(per_turn) for _ in range(n)] + [None] * unsourced
    return [Fact(f"f-{j}", "u1", f"{SENTENCES[texts[j % len(texts)]]} ({j})", source_turn=source)
            for j, source in enumerate(sources)]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error per layer divided by that layer's max |ref| (tensors ``[L, T, H, D]``)."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    diff = (got - ref).abs().flatten(1).amax(1)
    return (diff / ref.abs().flatten(1).amax(1).clamp(min=1e-30)).max().item()


def compare(shared: dict, whole: dict) -> tuple[float, float]:
    """(max relative error, max abs error) over keys and values of every fact."""
    assert shared.keys() == whole.keys()
    for fid in whole:
        assert shared[fid].token_ids == whole[fid].token_ids
    pairs = [(shared[f].keys, whole[f].keys) for f in whole] + [(shared[f].values, whole[f].values) for f in whole]
    rel = max((rel_err(a, b) for a, b in pairs), default=0.0)
    abs_ = max(((a - b).abs().max().item() for a, b in pairs if a.numel()), default=0.0)
    return rel, abs_


class TokenCounter:
    """Counts the input positions every forward pass of ``model`` runs (padding included)."""

    def __init__(self, model):
        self.count = 0
        self._handle = model.base_model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.count += kwargs["input_ids"].numel()

    def close(self) -> None:
        self._handle.remove()


def encode_counting(encoder: FactEncoder, facts, prefix) -> tuple[dict, int]:
    counter = TokenCounter(encoder.model)
    try:
        return encoder.encode(facts, TURNS, progress=False, prefix_ids=prefix), counter.count
    finally:
        counter.close()


# ---------------------------------------------------------------- exactness


@settings(max_examples=40, deadline=None)
@given(
    per_turn=st.lists(st.integers(0, 3), min_size=len(TURNS), max_size=len(TURNS)),
    unsourced=st.integers(0, 2),
    texts=st.lists(st.integers(0, len(SENTENCES) - 1), min_size=1, max_size=5),
    policy=st.sampled_from(sorted(POLICIES)),
    prefix=st.sampled_from(PREFIXES),
    batch_size=st.integers(1, 6),
    only_every=st.sampled_from([None, 2, 3]),
)
def test_shared_prefills_equal_whole_rows(tiny, per_turn, unsourced, texts, policy, prefix, batch_size, only_every,
                                          error_log):
    name, model, tokenizer = tiny
    facts = make_facts(per_turn, unsourced, texts)
    only = None if only_every is None else {f.fact_id for f in facts[::only_every]}
    whole = FactEncoder(model, tokenizer, POLICIES[policy], batch_size=1, share_prefixes=False)
    shared = FactEncoder(model, tokenizer, POLICIES[policy], batch_size=batch_size)
    prefix_ids = whole.tokenize(prefix)
    ref = whole.encode(facts, TURNS, progress=False, prefix_ids=prefix_ids, only=only)
    got = shared.encode(facts, TURNS, progress=False, prefix_ids=prefix_ids, only=only)
    rel, abs_ = compare(got, ref)
    label = f"{name}: shared prefills vs whole rows one at a time, rel / abs"
    error_log[label] = tuple(max(a, b) for a, b in zip(error_log.get(label, (0.0, 0.0)), (rel, abs_)))
    assert rel <= SHARE_REL_TOL, (policy, prefix, batch_size, rel)


def test_a_wrong_context_is_caught(tiny):
    """The comparison can fail: the same facts behind another window differ by order 1."""
    _, model, tokenizer = tiny
    facts = make_facts([1, 1, 1, 1, 1], 0, [0, 1, 2])
    turns1 = FactEncoder(model, tokenizer, POLICIES["turns1"]).encode(facts, TURNS, progress=False)
    turns2 = FactEncoder(model, tokenizer, POLICIES["turns2"]).encode(facts, TURNS, progress=False)
    assert compare(turns1, turns2)[0] > 1e-2


# ---------------------------------------------------------------- what is prefilled


def test_shared_prefills_are_the_default_on_a_cpu_only(tiny, monkeypatch):
    """On a GPU whole rows were faster (benchmarks/results/encode_speed_h200.json): the default
    follows the model's device; an explicit choice is kept."""
    _, model, tokenizer = tiny
    assert FactEncoder(model, tokenizer).share_prefixes is True
    assert FactEncoder(model, tokenizer, share_prefixes=False).share_prefixes is False
    import inferscale.encode.encoder as encoder_module

    default = FactEncoder(model, tokenizer)
    monkeypatch.setattr(encoder_module, "module_device", lambda m: torch.device("cuda", 0))
    assert FactEncoder(model, tokenizer).share_prefixes is False
    assert default.share_prefixes is False, "decided where the model is now, not where it was built"
    assert FactEncoder(model, tokenizer, share_prefixes=True).share_prefixes is True


def test_facts_of_one_turn_share_one_prefill(tiny):
    """Two facts per turn behind 2-turn windows and a prefix, one row at a time: the prefix
    once, each window once, every fact; whole rows prefill all three per fact."""
    _, model, tokenizer = tiny
    facts = make_facts([0, 2, 2, 2, 2], 0, [0, 1, 2, 3])
    policy = POLICIES["turns2"]
    shared = FactEncoder(model, tokenizer, policy, batch_size=1)
    prefix = shared.tokenize(PREFIXES[2])
    windows = [policy.context_ids(TURNS, s, shared.tokenize) for s in range(1, 5)]
    fact_tokens = sum(len(shared.fact_token_ids(f)) for f in facts)
    _, count = encode_counting(shared, facts, prefix)
    assert count == len(prefix) + sum(map(len, windows)) + fact_tokens
    whole = FactEncoder(model, tokenizer, policy, batch_size=1, share_prefixes=False)
    _, whole_count = encode_counting(whole, facts, prefix)
    assert whole_count == 2 * (4 * len(prefix) + sum(map(len, windows))) + fact_tokens


def test_a_window_over_every_fact_is_one_prefill(tiny):
    """Under "facts" with a window over all of them, every context is a prefix of the last
    one: one prefill of the facts before the last, then the facts (not n growing rows)."""
    _, model, tokenizer = tiny
    facts = make_facts([1, 1, 1, 1, 1], 2, [0, 1, 2, 3, 4, 5, 6])
    shared = FactEncoder(model, tokenizer, POLICIES["facts100"], batch_size=1)
    lengths = [len(shared.fact_token_ids(f)) for f in facts]
    _, count = encode_counting(shared, facts, [])
    assert count == sum(lengths[:-1]) + sum(lengths)


def test_sliding_window_models_take_whole_rows(tiny_model_dirs):
    """With sliding-window layers the cache's layout depends on the padding: whole rows."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from inferscale.encode.encoder import text_config

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["qwen2"])

    def config(**kw):
        return Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, **kw)

    assert not has_sliding_window(config(use_sliding_window=False))
    torch.manual_seed(0)
    sliding = Qwen2ForCausalLM(config(use_sliding_window=True, sliding_window=8, max_window_layers=0))
    assert has_sliding_window(text_config(sliding))
    encoder = FactEncoder(sliding, tokenizer, POLICIES["turns2"])
    assert encoder.share_prefixes is False
    facts = make_facts([0, 2, 0, 0, 0], 0, [0, 1])
    _, count = encode_counting(encoder, facts, [])
    window = POLICIES["turns2"].context_ids(TURNS, 1, encoder.tokenize)
    assert count == 2 * len(window) + sum(len(encoder.fact_token_ids(f)) for f in facts)


# ---------------------------------------------------------------- the plan (plain Python)


def test_common_prefix_and_nesting():
    assert common_prefix_length([]) == 0
    assert common_prefix_length([(1, 2, 3), (1, 2), (1, 2, 4)]) == 2
    assert common_prefix_length([(1,), (2,)]) == 0
    hosts, host_of = nest([(), (1,), (1, 2), (2,), (1, 3), (1, 2)])
    assert hosts == ((1, 2), (1, 3), (2,))
    assert [hosts[h] for h in host_of] == [(1, 2), (1, 2), (1, 2), (2,), (1, 3), (1, 2)]


contexts = st.lists(st.integers(0, 2), max_size=5).map(tuple)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(contexts, st.lists(st.integers(0, 9), max_size=3).map(tuple)), max_size=20),
       st.integers(1, 5), st.sampled_from([(), (7,), (7, 8)]))
def test_plan_covers_every_row_once_within_the_batch_size(pairs, batch_size, prefix):
    rows = [Row(prefix + c, ids) for c, ids in pairs]
    p = plan(rows, batch_size)
    assert all(row.context[: len(p.base)] == p.base for row in rows)
    assert len(p.base) >= len(prefix) or not rows
    assert sorted(i for chunk in p.chunks for i in chunk.rows) == list(range(len(rows)))
    hosts = [h for chunk in p.chunks for h in chunk.hosts]
    assert len(set(hosts)) == len(hosts)  # no host prefilled twice
    assert not any(a != b and b[: len(a)] == a for a in hosts for b in hosts)  # none nests in another
    for chunk in p.chunks:
        assert 1 <= len(chunk.hosts) <= batch_size
        assert len(chunk.rows) <= batch_size or len(chunk.hosts) == 1
        for i, h in zip(chunk.rows, chunk.host_of):
            tail = rows[i].context[len(p.base):]
            assert chunk.hosts[h][: len(tail)] == tail
    distinct = {row.context for row in rows}
    assert p.tokens(rows) <= sum(len(c) for c in distinct) + sum(len(row.ids) for row in rows)
