"""KV calibration: the correction's algebra, its file (checked on load), and the encoder and
the memory side applying it to facts' K/V at encoding (and to nothing else)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.encode.calibration import KVCalibration, corrected
from inferscale.encode.capture import attention_modules, key_biases
from inferscale.errors import ConfigError, ModelMismatchError
from inferscale.kv import FactKV

shapes = st.tuples(st.integers(1, 3), st.integers(0, 5), st.integers(1, 3), st.integers(1, 8))  # L, T, H, D


def _kv(layers, tokens, heads, size, gen, dtype=torch.float32) -> FactKV:
    keys = (torch.randn(layers, tokens, heads, size, generator=gen) * 20).to(dtype)
    return FactKV(tuple(range(tokens)), keys, torch.randn(layers, tokens, heads, size, generator=gen).to(dtype))


def _positive(shape, gen) -> torch.Tensor:
    return torch.rand(shape, generator=gen) * 1.5 + 0.25


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(0, 2**31 - 1))
def test_the_head_form_is_the_channel_form_with_one_scale_per_head_and_the_bias_is_kept(shape, seed):
    layers, tokens, heads, size = shape
    gen = torch.Generator().manual_seed(seed)
    kv, bias = _kv(*shape, gen), torch.randn(layers, heads, size, generator=gen) * 50
    c, s = _positive((layers, heads), gen), _positive((layers, heads), gen)
    head = KVCalibration(c, s).apply(kv, bias)
    channel = KVCalibration(c[..., None].expand(-1, -1, size), s[..., None].expand(-1, -1, size)).apply(kv, bias)
    torch.testing.assert_close(head.keys, channel.keys, rtol=0, atol=0)
    torch.testing.assert_close(head.values, channel.values, rtol=0, atol=0)
    # the content (k - b) is scaled, the bias is not; values are scaled
    torch.testing.assert_close(head.keys - bias[:, None], c[:, None, :, None] * (kv.keys - bias[:, None]))
    torch.testing.assert_close(head.values, s[:, None, :, None] * kv.values)
    assert head.token_ids == kv.token_ids
    # a key that is all bias stays put whatever the scale
    at_bias = FactKV(kv.token_ids, bias[:, None].expand_as(kv.keys).clone(), kv.values)
    torch.testing.assert_close(KVCalibration(c, s).apply(at_bias, bias).keys, at_bias.keys)


@settings(max_examples=40, deadline=None)
@given(shapes, st.integers(0, 2**31 - 1), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_shifts_add_per_channel_and_the_identity_changes_nothing(shape, seed, dtype):
    layers, tokens, heads, size = shape
    gen = torch.Generator().manual_seed(seed)
    kv, bias = _kv(*shape, gen, dtype), torch.randn(layers, heads, size, generator=gen)
    ones = torch.ones(layers, heads, size)
    same = KVCalibration(ones, ones).apply(kv, bias)
    assert same.keys.dtype == dtype and same.values.dtype == dtype
    torch.testing.assert_close(same.keys.float(), kv.keys.float(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(same.values, kv.values, rtol=0, atol=0)
    dk, dv = torch.randn(layers, heads, size, generator=gen), torch.randn(layers, heads, size, generator=gen)
    shifted = KVCalibration(ones, ones, dk, dv).apply(FactKV(kv.token_ids, kv.keys.float(), kv.values.float()), bias)
    torch.testing.assert_close(shifted.keys, kv.keys.float() + dk[:, None], rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(shifted.values, kv.values.float() + dv[:, None])


def test_gradients_reach_every_parameter_of_the_correction():
    keys, values, bias = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4), torch.randn(2, 1, 4)
    params = [torch.ones(2, 1, 4, requires_grad=True) for _ in range(2)] + [torch.zeros(2, 1, 4, requires_grad=True) for _ in range(2)]
    k, v = corrected(keys, values, bias, *params)
    (k.square().sum() + v.square().sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def _write(tmp_path, data, name="calibration.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_a_file_round_trips_and_is_checked_against_the_model(tmp_path):
    gen = torch.Generator().manual_seed(0)
    fitted = KVCalibration(_positive((2, 1, 4), gen), _positive((2, 1, 4), gen), torch.randn(2, 1, 4), torch.randn(2, 1, 4),
                           model="tiny")
    path = _write(tmp_path, fitted.to_dict())
    loaded = KVCalibration.load(path)
    assert loaded.form == "channel" and loaded.model == "tiny" and loaded.source == str(path)
    for name in ("key_scale", "value_scale", "key_shift", "value_shift"):
        torch.testing.assert_close(getattr(loaded, name), getattr(fitted, name))
    assert loaded.check(2, 1, 4) is loaded
    for shape in ((3, 1, 4), (2, 2, 4), (2, 1, 8)):
        with pytest.raises(ModelMismatchError, match="fitted for 2 layers x 1 KV heads x 4 \\(tiny\\)"):
            loaded.check(*shape)
    with pytest.raises(ModelMismatchError):
        loaded.apply(_kv(2, 3, 1, 8, gen), torch.zeros(2, 1, 8))
    head = KVCalibration.load(_write(tmp_path, {"key_scale": [[1.2], [0.9]], "value_scale": [[1.0], [1.1]]}))
    assert head.form == "head" and head.check(2, 1, 64) is head  # any head size


@pytest.mark.parametrize("data, match", [
    ("{not json", "calibration .*: Expecting property name"),
    ({"key_scale": [[1.0]]}, "with key_scale and value_scale"),
    ([1, 2], "with key_scale and value_scale"),
    ({"key_scale": [[1.0], [1.0, 2.0]], "value_scale": [[1.0], [1.0]]}, "not a rectangular list"),
    ({"key_scale": [["a"]], "value_scale": [[1.0]]}, "not a rectangular list"),
    ({"key_scale": [[1.0]], "value_scale": [[1.0, 1.0]]}, "must both be"),
    ({"key_scale": [1.0], "value_scale": [1.0]}, "must both be"),
    ({"key_scale": [[0.0]], "value_scale": [[1.0]]}, "positive"),
    ({"key_scale": [[1.0]], "value_scale": [[float("nan")]]}, "not finite"),
    ({"key_scale": [[[1.0, 1.0]]], "value_scale": [[[1.0, 1.0]]], "key_shift": [[[1.0]]]}, "key_shift \\(1, 1, 1\\)"),
    ({"key_scale": [[1.0]], "value_scale": [[1.0]], "value_shift": [[1.0]]}, "value_shift \\(1, 1\\)"),
])
def test_a_file_that_is_not_a_calibration_is_a_config_error(tmp_path, data, match):
    with pytest.raises(ConfigError, match=match):
        KVCalibration.load(_write(tmp_path, data))


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="calibration .*nowhere.json"):
        KVCalibration.load(tmp_path / "nowhere.json")


# ---------------------------------------------------------------- on a real (tiny) model


def test_key_biases_are_the_projection_biases_where_the_stored_keys_have_them(tiny_model_dirs):
    from inferscale.encode.weights import load_causal_lm

    for name, has_bias in (("qwen2", True), ("llama", False), ("qwen3", False)):  # qwen3: k_norm is stored
        model, _ = load_causal_lm(tiny_model_dirs[name])
        attn = attention_modules(model)
        heads, size = model.config.num_key_value_heads, model.config.head_dim if name == "qwen3" else \
            model.config.hidden_size // model.config.num_attention_heads
        bias = key_biases(attn, heads, size)
        assert bias.shape == (len(attn), heads, size)
        if has_bias:
            for layer, module in enumerate(attn):
                torch.testing.assert_close(bias[layer].flatten(), module.k_proj.bias.float())
        else:
            assert not bias.any()


def test_the_encoder_corrects_facts_but_not_the_prefix(tiny_model_dirs):
    from inferscale.encode import FactEncoder, FactsWindow
    from inferscale.encode.weights import load_causal_lm
    from inferscale.facts import Fact

    model, tokenizer = load_causal_lm(tiny_model_dirs["qwen2"])
    plain = FactEncoder(model, tokenizer, FactsWindow(FactsWindow.Options(window=2)), batch_size=1)
    gen = torch.Generator().manual_seed(1)
    shape = (plain.num_layers, plain.num_kv_heads, plain.head_size)
    calibration = KVCalibration(_positive(shape, gen), _positive(shape, gen), torch.randn(shape, generator=gen),
                                torch.randn(shape, generator=gen))
    fixed = FactEncoder(model, tokenizer, FactsWindow(FactsWindow.Options(window=2)), batch_size=1, calibration=calibration)
    facts = [Fact(f"f{i}", "u", text) for i, text in enumerate(["Ana lives in Lima.", "Bo has two dogs.", "Cy sings."])]
    prefix = tokenizer.encode("Facts:\n", add_special_tokens=False)
    before, after = plain.encode(facts, progress=False, prefix_ids=prefix), fixed.encode(facts, progress=False, prefix_ids=prefix)
    assert fixed.key_bias.any()  # Qwen2 has key biases
    for fid, kv in before.items():
        want = calibration.apply(kv, plain.key_bias)
        torch.testing.assert_close(after[fid].keys, want.keys, rtol=0, atol=0)
        torch.testing.assert_close(after[fid].values, want.values, rtol=0, atol=0)
    torch.testing.assert_close(fixed.encode_ids(prefix).keys, plain.encode_ids(prefix).keys, rtol=0, atol=0)
    wrong = KVCalibration(torch.ones(shape[0] + 1, shape[1]), torch.ones(shape[0] + 1, shape[1]))
    with pytest.raises(ModelMismatchError, match=f"this model has {shape[0]} x"):
        FactEncoder(model, tokenizer, calibration=wrong)


def test_the_memory_side_reads_the_configured_file_at_start(tiny_model_dirs, tmp_path):
    from inferscale.api import Context, MemoryAPI
    from inferscale.config import Config

    model = str(tiny_model_dirs["qwen2"])
    bad = _write(tmp_path, {"key_scale": [[0.0]], "value_scale": [[1.0]]}, "bad.json")
    with pytest.raises(ConfigError, match="positive"):
        MemoryAPI(Context(Config.from_dict({"model": model, "data_dir": str(tmp_path / "a"), "calibration": str(bad)})))
    with pytest.raises(ConfigError, match="calibration must be a string"):
        Config.from_dict({"calibration": 1.5})
    plain = MemoryAPI(Context(Config.from_dict({"model": model, "data_dir": str(tmp_path / "b")})))
    layers, heads = plain.encoder.num_layers, plain.encoder.num_kv_heads
    good = _write(tmp_path, {"key_scale": [[0.5] * heads] * layers, "value_scale": [[2.0] * heads] * layers}, "good.json")
    fixed = MemoryAPI(Context(Config.from_dict({"model": model, "data_dir": str(tmp_path / "c"), "calibration": str(good)})))
    facts = ["Ann has a cat named Miso.", "Ann runs on Sundays."]
    plain.add_facts("ann", facts, progress=False)
    fixed.add_facts("ann", facts, progress=False)
    a, b = ({f.text: memory.context.record.load_user("ann")[f.fact_id] for f in memory.list_facts("ann")}
            for memory in (plain, fixed))
    assert sorted(a) == sorted(b) == sorted(facts)
    for text in facts:
        torch.testing.assert_close(b[text].values.float(), 2.0 * a[text].values.float())
        assert not torch.equal(b[text].keys, a[text].keys)
    plain.close(), fixed.close()
