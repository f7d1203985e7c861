"""The connector on real vLLM (CPU): exactness, composition, controls, fallbacks, isolation.

One in-process engine per (model, dtype) at a time (module-scoped, parametrized
fixture). Memory is encoded with the core's FactEncoder (transformers, fp32)
and stored with the disk store the connector reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiny_models
import vllm_harness as vh

from inferscale.connector import compat
import vllm_probe
from inferscale.compose.prompt import PromptFormat, fact_token_ids
from inferscale.compose.request import make_params
from inferscale.compose.rope import RotaryEmbedding
from inferscale.compose.segment import compose_segment
from inferscale.config import DEFAULT_INSTRUCTION
from inferscale.encode.encoder import FactEncoder
from inferscale.storage.disk import DiskStore

pytestmark = pytest.mark.slow

FACTS = ["Alice has a cat named Miso.", "Alice works as a nurse in Lisbon."]
QUERY = "What is the name of my cat?"
#: max |Δlogprob| allowed between injected memory and plain prefill of the same prompt.
#: The encoder (transformers) and vLLM use different kernels, so fp32 agrees to
#: kernel rounding; bf16 K/V are rounded once more when cast into the cache.
TOLERANCE = {"float32": 2e-3, "bfloat16": 0.15}
ENCODE_DTYPE: dict[str, str] = {}  # the product encodes in fp32 and casts into the cache


def _models(env: str, default: str) -> list[tuple[str, str]]:
    """``name:dtype`` pairs; the GPU run sets INFERSCALE_TEST_MODELS (FlashAttention has no fp32)."""
    return [tuple(item.split(":")) for item in os.environ.get(env, default).split(",")]


MODELS = _models("INFERSCALE_TEST_MODELS", "llama:float32,qwen2:float32,qwen3:float32,"
                 "llama:bfloat16,qwen3:bfloat16,qwen05:float32")
REPLAY_MODELS = _models("INFERSCALE_REPLAY_MODELS", "llama:float32,llama:bfloat16,qwen3:bfloat16")


@dataclass
class Served:
    name: str
    dtype: str
    llm: object
    encoder: FactEncoder
    tokenizer: object
    disk: DiskStore
    fmt: PromptFormat
    prefix: list[int]
    rope: RotaryEmbedding

    def facts(self, texts=FACTS) -> list[list[int]]:
        return [fact_token_ids(self.tokenizer, t) for t in texts]

    def prompt(self, fact_tokens, query=QUERY) -> list[int]:
        return self.fmt.prompt_ids(self.tokenizer, fact_tokens, query)

    def request(self, user: str, fact_ids: list[str], segment: list[int], recompute_tokens=None, key_scale=None):
        """The params and salt the server would give this request (see vllm_harness.memory_request)."""
        return vh.memory_request(self.disk.root.parent, user, fact_ids, segment, recompute_tokens, key_scale)

    def store_joint(self, user: str, texts=FACTS) -> tuple[list[str], list[int]]:
        """Facts encoded jointly behind the prefix (exact at their positions)."""
        ids, context, kvs = [], list(self.prefix), {}
        for i, tokens in enumerate(self.facts(texts)):
            kvs[f"f{i}"] = self.encoder.encode_ids(tokens, context_ids=context)
            ids.append(f"f{i}")
            context += tokens
        self.disk.put(user, kvs)
        return ids, context


def model_dir(name: str, dtype: str, request) -> Path:
    if name == "qwen05":
        return request.getfixturevalue("qwen05_dir")
    if name == "smollm2":  # real SmolLM2-135M-Instruct (small enough for the GPU machine)
        from inferscale.encode.weights import model_dir as converted

        return converted("smollm2-135m-instruct", dtype)
    return tiny_models.tiny_model_dir(name, dtype)


#: the engine this module has running. vLLM keeps one KV-connector agent per process, so a second
#: in-process engine started beside the first would drive its workers with the first one's connector
#: (and its data directory): each fixture's engine is stopped before the next one starts
_LIVE: list[Served] = []


def stop(served: Served) -> None:
    if served in _LIVE:
        _LIVE.remove(served)
        vh.close_engine(served.llm)
        served.encoder.close()


def start(name, dtype, request, tmp_path_factory, **engine_kwargs) -> Served:
    for running in list(_LIVE):
        stop(running)
    path = model_dir(name, dtype, request)
    data = tmp_path_factory.mktemp(f"mem-{name}-{dtype}")
    encoder = FactEncoder.from_spec(str(path), dtype=ENCODE_DTYPE.get(dtype, "float32"))
    tokenizer = encoder.tokenizer
    fmt = PromptFormat.from_tokenizer(tokenizer, DEFAULT_INSTRUCTION)
    disk = DiskStore(DiskStore.Options(root=str(data / "kv")))
    prefix = fmt.prefix_ids(tokenizer)
    vh.write_prefix(disk, encoder, prefix)
    llm = vh.make_engine(path, data, dtype, **engine_kwargs)
    rope = RotaryEmbedding.from_hf_config(encoder.model.config)
    served = Served(name, dtype, llm, encoder, tokenizer, disk, fmt, prefix, rope)
    _LIVE.append(served)
    return served


@pytest.fixture(scope="module", params=MODELS, ids=lambda p: f"{p[0]}-{p[1]}")
def served(request, tmp_path_factory):
    s = start(*request.param, request, tmp_path_factory)
    s.llm.apply_model(vllm_probe.install)
    yield s
    stop(s)


def test_injection_matches_plain_prefill(served, error_log):
    fact_ids_, segment = served.store_joint("u1")
    prompt = served.prompt(served.facts())
    plain_tokens, _, plain = vh.greedy(served.llm, prompt)
    params, salt = served.request("u1", fact_ids_, segment)
    tokens, _, out = vh.greedy(served.llm, prompt, params, salt)
    delta, agree = vh.logprob_gap(out, plain)
    error_log[f"injection max|Δlogprob| {served.name} {served.dtype}"] = delta
    assert vh.report(out) == {"injected_tokens": len(segment), "recomputed_tokens": 0, "recompute_budget": 0,
                              "engine_busy": None, "fallback": None}  # a fixed budget of 0
    assert out.num_cached_tokens == len(segment)
    assert delta <= TOLERANCE[served.dtype]
    if served.dtype == "float32":
        assert tokens == plain_tokens


def test_composed_facts_give_vllms_own_layer0_keys(served, error_log):
    """Independently encoded facts, composed at new offsets, rotated by the core:
    layer-0 keys equal the keys vLLM computes for those tokens at those positions."""
    texts = ["Bob keeps bees on his roof.", "Bob's sister lives in Porto.", "Bob plays the cello."]
    served.disk.put("u2", {f"g{i}": served.encoder.encode_ids(t) for i, t in enumerate(served.facts(texts))})
    order = ["g2", "g0", "g1"]
    segment = compose_segment(served.disk, served.rope, "u2", order)
    tokens = served.facts([texts[2], texts[0], texts[1]])
    prompt = served.prompt(tokens)
    assert prompt[: len(segment.token_ids)] == segment.token_ids
    vllm_probe.clear()
    vh.greedy(served.llm, prompt, max_tokens=1, salt="layer0-probe")
    vllm_keys, _ = vllm_probe.first_write(0)
    m = len(segment.token_ids)
    theirs = vllm_keys[:m].float().cpu()
    ours = segment.keys[0].to(vllm_keys.dtype).float().cpu()
    err = (ours - theirs).abs().max().item()
    scale = theirs.abs().max().item()
    error_log[f"layer-0 keys max abs err {served.name} {served.dtype}"] = err
    assert err <= (1e-4 if served.dtype == "float32" else 2e-2 * scale)


def test_corrupted_kv_changes_the_output(served):
    """Control: the injected K/V is really used."""
    fact_ids_, segment = served.store_joint("u3")
    kvs = served.disk.load_user("u3")
    served.disk.put("u3", {f: vh.noisy(kv) for f, kv in kvs.items()})
    prompt = served.prompt(served.facts())
    _, plain_lp, _ = vh.greedy(served.llm, prompt)
    params, salt = served.request("u3", fact_ids_, segment)
    _, lp, out = vh.greedy(served.llm, prompt, params, salt)
    assert vh.report(out)["injected_tokens"] == len(segment)
    assert max(abs(a - b) for a, b in zip(lp, plain_lp)) > 1e-2


def test_tail_recompute_prefills_the_facts_that_fit_the_budget(served, error_log):
    """Every fact's stored K/V is corrupt: facts inside the budget are prefilled from their
    tokens (the store is never read for them), the ones before them are injected."""
    fact_ids_, segment = served.store_joint("u6")
    served.disk.put("u6", {f: vh.noisy(kv, seed=2) for f, kv in served.disk.load_user("u6").items()})
    tokens = served.facts()
    prompt = served.prompt(tokens)
    plain = vh.greedy(served.llm, prompt)
    prefix, facts = len(served.prefix), sum(map(len, tokens))
    for budget, recomputed in ((facts, facts), (len(tokens[-1]), len(tokens[-1])), (len(tokens[-1]) - 1, 0)):
        params, salt = served.request("u6", fact_ids_, segment, recompute_tokens=budget)
        out = vh.greedy(served.llm, prompt, params, salt)
        report = vh.report(out[2])
        assert (report["fallback"], report["recomputed_tokens"]) == (None, recomputed), budget
        assert report["injected_tokens"] == out[2].num_cached_tokens == len(segment) - recomputed, budget
        if recomputed == facts:  # only the exact prefix injected: plain prefill's output
            delta, _ = vh.logprob_gap(out[2], plain[2])
            error_log[f"tail recompute of every fact max|Δlogprob| {served.name} {served.dtype}"] = delta
            assert delta <= TOLERANCE[served.dtype]
        else:  # corrupt facts injected: the output moves
            assert out[1] != plain[1]
    assert len(segment) == prefix + facts


def test_key_scale_reaches_the_attention(served):
    fact_ids_, segment = served.store_joint("u7")
    prompt = served.prompt(served.facts())
    runs = [vh.greedy(served.llm, prompt, *served.request("u7", fact_ids_, segment, key_scale=c)) for c in (1.0, 2.0)]
    assert all(vh.report(r[2])["injected_tokens"] == len(segment) for r in runs)
    assert max(abs(a - b) for a, b in zip(runs[0][1], runs[1][1])) > 1e-3


def test_prefix_cache_never_serves_injected_kv_to_plain_requests(served):
    fact_ids_, segment = served.store_joint("u4")
    served.disk.put("u4", {f: vh.noisy(kv, seed=1) for f, kv in served.disk.load_user("u4").items()})
    prompt = served.prompt(served.facts(), query="Where does Alice work?")
    vh.greedy(served.llm, prompt)  # plain blocks in vLLM's prefix cache: both plain runs below read them
    plain = vh.greedy(served.llm, prompt)[:2]
    params, salt = served.request("u4", fact_ids_, segment)
    injected = vh.greedy(served.llm, prompt, params, salt)[:2]
    again = vh.greedy(served.llm, prompt)
    assert injected != plain
    assert again[:2] == plain
    reused = vh.greedy(served.llm, prompt, params, salt)  # same memory again: prefix-cache hit
    block = served_block(served)
    assert reused[:2] == injected and reused[2].num_cached_tokens >= len(segment) // block * block


def served_block(served) -> int:
    return served.llm.llm_engine.vllm_config.cache_config.block_size


def _fallback_cases(served):
    fact_ids_, segment = served.store_joint("u5")
    served.disk.put("u6", {"other": served.encoder.encode_ids(served.facts()[0])})
    good = served.prompt(served.facts())
    params, salt = served.request("u5", fact_ids_, segment)
    wrong = served.prompt(served.facts(["Alice has a dog named Rex.", FACTS[1]]))
    return {
        "unknown_user": (good, make_params("nobody", fact_ids_), salt),
        "unknown_fact": (good, make_params("u5", ["f0", "f9"]), salt),
        "foreign_fact": (good, make_params("u5", ["f0", "other"]), salt),
        "token_mismatch": (wrong, params, salt),
        "missing_cache_salt": (good, params, None),
        "invalid_params": (good, {"inferscale": {"user_id": 5, "fact_ids": "f0"}}, salt),
        "prompt_too_short": (segment, params, salt),
    }


#: the reason the server logs for each case; the client is told only "refused" (or "invalid_params")
#: (the salt covers the prompt's head and is checked first: a request naming a user, facts or tokens its salt
#: was not made for is refused for that)
EXPECTED = {"unknown_user": "missing_cache_salt", "unknown_fact": "missing_cache_salt", "foreign_fact": "missing_cache_salt",
            "token_mismatch": "missing_cache_salt", "missing_cache_salt": "missing_cache_salt",
            "invalid_params": "invalid_params", "prompt_too_short": "prompt_too_short"}


def test_every_failure_falls_back_to_plain_prefill(served):
    for case, (prompt, params, salt) in _fallback_cases(served).items():
        plain = vh.greedy(served.llm, prompt, max_tokens=4)[0]
        with vh.connector_log() as log:
            tokens, _, out = vh.greedy(served.llm, prompt, params, salt, max_tokens=4)
        told = "invalid_params" if case == "invalid_params" else "refused"
        assert vh.report(out) == {"injected_tokens": 0, "recomputed_tokens": 0, "recompute_budget": 0,
                                  "engine_busy": None, "fallback": told}, case
        assert any(f"({EXPECTED[case]})" in line for line in log), (case, log)
        assert tokens == plain, case


def test_corrupt_file_is_detected_on_load_and_recomputed(served):
    fact_ids_, segment = served.store_joint("u7")
    (path,) = served.disk.user_dir("u7").glob("seg-*.safetensors")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # flip a byte of the K/V; the index (token ids) still reads
    path.write_bytes(bytes(data))
    prompt = served.prompt(served.facts())
    plain = vh.greedy(served.llm, prompt, max_tokens=4)[0]
    params, salt = served.request("u7", fact_ids_, segment)
    tokens, _, out = vh.greedy(served.llm, prompt, params, salt, max_tokens=4)
    if compat.load_failure_policy() == "fail":  # a release whose rollback answers wrongly: an error instead
        assert out.outputs[0].finish_reason == "error", (tokens, out.outputs[0].finish_reason)
        return
    assert vh.report(out)["fallback"] == "load_error"
    assert tokens == plain


@pytest.mark.parametrize("k", [0])
def test_fuzzed_params_never_crash_the_engine(served, k):
    if (served.name, served.dtype) != MODELS[0]:
        pytest.skip("fuzzed on one engine")
    prompt = served.prompt(served.facts())
    plain = vh.greedy(served.llm, prompt, max_tokens=2)[0]
    int64 = st.integers(-(2**63), 2**63 - 1)  # vLLM rejects wider ints before the engine
    ids = st.from_regex(r"[A-Za-z0-9_.:-]{0,12}", fullmatch=True) | int64 | st.none()
    values = st.one_of(
        st.none(), int64, st.text(max_size=10), st.lists(ids, max_size=5),
        st.dictionaries(st.sampled_from(["user_id", "fact_ids", "x"]),
                        st.one_of(ids, st.lists(ids, max_size=300)), max_size=3),
    )

    # vLLM itself types kv_transfer_params as a dict (its front end rejects anything else
    # before the engine sees it), so the fuzzing varies everything inside the dict
    top = st.dictionaries(st.sampled_from(["inferscale", "other", "do_remote_prefill"]), values, max_size=2)

    @given(params=top | st.builds(lambda v: {"inferscale": v}, values), salt=st.none() | st.text(max_size=8))
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    def run(params, salt):
        tokens, _, out = vh.greedy(served.llm, prompt, params, salt, max_tokens=2)
        assert tokens == plain
        assert vh.report(out).get("injected_tokens", 0) == 0

    run()


# ------------------------------------------------------------------ strict control


@pytest.fixture(scope="module", params=REPLAY_MODELS, ids=lambda p: f"{p[0]}-{p[1]}")
def replay(request, tmp_path_factory):
    s = start(*request.param, request, tmp_path_factory, connector=("ReplayConnector", "plugins.replay_connector"))
    s.llm.apply_model(vllm_probe.install)
    yield s
    stop(s)


def test_reinjecting_vllms_own_kv_is_bit_exact(replay, error_log):
    """On CPU the re-injected run is bit-identical to plain prefill. On GPU it
    cannot be: FlashAttention splits "prefill all tokens" and "attend the
    question to cached K/V" into different work partitions, so the sums round
    differently (vLLM's own prefix caching shows the same); there the shared
    top-k logprobs must agree to bf16 rounding."""
    fact_ids_, segment = replay.store_joint("u1")
    prompt = replay.prompt(replay.facts())
    vllm_probe.clear()
    plain_tokens, _, plain = vh.greedy(replay.llm, prompt, salt="plain")
    params, salt = replay.request("u1", fact_ids_, segment)
    tokens, _, out = vh.greedy(replay.llm, prompt, params, salt)
    delta, agree = vh.logprob_gap(out, plain)
    error_log[f"replay of vLLM's own KV max|Δlogprob| {replay.name} {replay.dtype}"] = delta
    assert vh.report(out).get("injected_tokens") == len(segment)  # replayed, not recomputed after a failed load
    assert out.num_cached_tokens == len(segment)
    if torch.cuda.is_available():
        assert delta <= TOLERANCE[replay.dtype]
    else:
        assert tokens == plain_tokens and delta == 0.0
