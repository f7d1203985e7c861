"""Background loads (Config.tuning.async_loads = "always") on a real vLLM engine: the request waits
in vLLM's WAITING_FOR_REMOTE_KVS while others run, its K/V is written by the background writer
and reported through get_finished, and every path ends with exact bookkeeping: a load that
arrives, one that fails (prefilled instead), one whose request is aborted while it loads (its
blocks freed only once the load is reported), nothing left in the connector's state.

On a CPU the background writer writes when it issues and reports the load a step later; on a GPU
(run the same file there) it copies and writes on a stream of its own.
"""

from __future__ import annotations

import threading

import pytest
import torch

import tiny_models
import vllm_harness as vh
from inferscale.connector import compat
from inferscale.inject.load_mode import LoadMode
from plugins import background_connectors as rec

pytestmark = pytest.mark.slow

FACTS = ["Alice has a cat named Miso.", "Alice works as a nurse in Lisbon."]
OTHER = ["Bob keeps bees on his roof.", "Bob's sister lives in Porto.", "Bob plays the cello."]
CONNECTOR = ("RecordingConnector", "plugins.background_connectors")
#: FlashAttention has no float32; in bfloat16 injected K/V answers close to plain prefill, not token for token
DTYPE = "bfloat16" if torch.cuda.is_available() else "float32"


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    """Two users' memory (encoded jointly: injection is exact) and each one's prompt."""
    data = tmp_path_factory.mktemp("background")
    path = tiny_models.tiny_model_dir("qwen2", DTYPE)
    alice = vh.joint_memory(path, data, "alice", FACTS, "What is my cat called?")
    bob = vh.joint_memory(path, data, "bob", OTHER, "Where does my sister live?")
    return path, data, {"alice": (alice, ["f0", "f1"]), "bob": (bob, ["f0", "f1", "f2"])}


def report(out) -> dict:
    """The client's report, without the recompute budget it got (none here: no tail)."""
    return {key: value for key, value in vh.report(out).items() if key in ("injected_tokens", "recomputed_tokens",
                                                                          "fallback")}


def answers(llm, data, memory_of, users, nonce: str = ""):
    """Each user's greedy answer with memory, all requests in one batch (one generate); a
    ``nonce`` suffixes the salts, so that no block comes from vLLM's prefix cache."""
    from vllm import SamplingParams

    prompts, params = [], []
    for user in users:
        (prompt, segment), fact_ids = memory_of[user]
        kv_params, salt = vh.memory_request(data, user, fact_ids, segment)
        prompts.append({"prompt_token_ids": prompt, "cache_salt": salt + nonce})
        params.append(SamplingParams(max_tokens=vh.GREEDY_TOKENS, temperature=0.0, ignore_eos=True,
                                     extra_args={"kv_transfer_params": kv_params}))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(out.outputs[0].token_ids), report(out), out.num_cached_tokens) for out in outs]


def run_steps(llm, prompt, kv_params, salt, give_up_s: float = 300):
    """One greedy request through the engine step by step: its tokens and RequestOutput (a request
    that never finishes, e.g. one loaded again and again, fails the test instead of hanging it;
    the engine steps idly, as fast as it can, while a user is read from disk for a load)."""
    import time

    from vllm import SamplingParams

    engine_ = llm.llm_engine
    params = SamplingParams(max_tokens=vh.GREEDY_TOKENS, temperature=0.0, ignore_eos=True,
                            extra_args={"kv_transfer_params": kv_params})
    req_id = engine_.add_request(f"bounded-{len(rec.WRITES)}-{salt}", {"prompt_token_ids": prompt, "cache_salt": salt},
                                 params)
    began = time.monotonic()
    while time.monotonic() - began < give_up_s:
        for out in engine_.step():
            if out.finished:
                return list(out.outputs[0].token_ids), out
    engine_.abort_request([req_id], internal=True)
    pytest.fail(f"the request did not finish in {give_up_s} s; loads: {rec.WRITES}")


def engine(memory, async_loads: str, **kwargs):
    path, data, _ = memory
    rec.WRITES.clear()
    return vh.make_engine(path, data, DTYPE, connector=CONNECTOR, async_loads=async_loads, **kwargs)


@pytest.fixture(scope="module")
def synchronous(memory):
    """What loads before the forward pass answer (each request alone, and the plain prefill)."""
    llm = engine(memory, "never")
    try:
        _, data, memory_of = memory
        alone = {user: answers(llm, data, memory_of, [user])[0] for user in memory_of}
        plain = {user: vh.greedy(llm, memory_of[user][0][0])[0] for user in memory_of}
        assert {kind for kind, _ in rec.WRITES} == {"before"}
        return alone, plain
    finally:
        vh.close_engine(llm)


@pytest.fixture(scope="module")
def background(memory, synchronous):
    llm = engine(memory, "always")
    yield llm
    vh.close_engine(llm)


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def assert_nothing_left(llm):
    """The connector's state on both sides is empty, and vLLM holds no request."""
    scheduler, worker = rec.SIDES["scheduler"], rec.SIDES["worker"]
    assert scheduler._background.waits_kept() == 0
    assert (len(scheduler._background), scheduler._plans, scheduler._pending, scheduler._loaded_blocks,
            scheduler._failed, scheduler._beside) == (0, {}, {}, {}, set(), set())
    assert (worker.background.loading, worker._background_queue) == (set(), [])
    assert worker.background.take_load_errors() == set() and worker.writer.take_load_errors() == set()
    assert not scheduler_of(llm).requests


def test_a_batch_of_background_loads_answers_as_loads_before_the_forward_pass(background, memory, synchronous):
    _, data, memory_of = memory
    alone, plain = synchronous
    users = ["alice", "bob", "alice", "bob", "alice"]  # the same memory twice in one batch, beside others
    rec.PARKED.clear()
    got = answers(background, data, memory_of, users)
    for user, (tokens, report, cached) in zip(users, got):
        segment = memory_of[user][0][1]
        assert (tokens, report, cached) == alone[user]
        assert report == {"injected_tokens": len(segment), "recomputed_tokens": 0, "fallback": None}
        assert tokens == plain[user] or DTYPE != "float32"
    assert rec.WRITES and all(kind == "background" for kind, _ in rec.WRITES), rec.WRITES
    # each request's wait counted once it ran: reported after at least the parking schedule, run after that
    assert len(rec.PARKED) == len(users)
    assert all(0 <= reported < scheduled and seconds > 0 for reported, scheduled, seconds in rec.PARKED), rec.PARKED
    assert_nothing_left(background)


def test_a_request_aborted_while_its_load_waits_frees_its_blocks_once_the_load_is_reported(background, memory,
                                                                                           synchronous):
    """A load is reported in the step that issues it; one that waits for its user's read is not
    issued yet: aborted then, its blocks stay vLLM's until the worker drops the load and reports
    it, unwritten, and are then freed and used again."""
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    _, data, memory_of = memory
    (prompt, segment), fact_ids = memory_of["alice"]
    kv_params, salt = vh.memory_request(data, "alice", fact_ids, segment)
    salt += ":aborted"  # (a suffix: no block of the earlier tests' from vLLM's prefix cache)
    worker = rec.SIDES["worker"].background
    worker.tiers.memory.delete("alice")  # her load waits for a read of the store of record
    scheduler = scheduler_of(background)
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    engine_ = background.llm_engine
    req_id = engine_.add_request("doomed", {"prompt_token_ids": prompt, "cache_salt": salt},
                                 SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": kv_params}))
    rec.WRITES.clear()
    record, go = worker.tiers.record, threading.Event()
    read_user = record.read_user
    record.read_user = lambda user_id: go.wait(60) and read_user(user_id)  # a slow disk, until the test says go
    try:
        engine_.step()  # scheduled: its blocks allocated, its load waiting for alice's read (not issued, not reported)
        assert scheduler.requests[req_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert rec.WRITES == [] and worker.loading == {req_id}
        engine_.abort_request(["doomed"])
        assert req_id in scheduler.requests  # finished, but its blocks are vLLM's until the load is reported
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() < free
        for _ in range(20):  # (vLLM needs the load reported to free its blocks: a step or two here)
            if req_id not in scheduler.requests:
                break
            engine_.step()
        assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free
        assert rec.WRITES == []  # dropped unwritten
    finally:
        go.set()
        del record.read_user
    worker.fills.close()
    assert_nothing_left(background)
    # the freed blocks are used again: a request with memory and a plain one still answer right
    alone, plain = synchronous
    assert answers(background, data, memory_of, ["alice"], ":after-abort")[0] == alone["alice"]
    assert vh.greedy(background, prompt)[0] == plain["alice"]
    assert_nothing_left(background)


def corrupt_memory(memory, user: str):
    """``user`` with alice's facts, whose stored K/V is found corrupt when the worker reads it
    (the index, and so the planning, still reads); the request's params, salt and prompt."""
    from inferscale.storage.disk import DiskStore

    path, data, memory_of = memory
    prompt, segment = vh.joint_memory(path, data, user, FACTS, "What is my cat called?")
    (seg,) = DiskStore(DiskStore.Options(root=str(data / "kv"))).user_dir(user).glob("seg-*.safetensors")
    damaged = bytearray(seg.read_bytes())
    damaged[-100] ^= 0xFF  # flip a byte of the K/V
    seg.write_bytes(bytes(damaged))
    params, salt = vh.memory_request(data, user, ["f0", "f1"], segment)
    return params, salt, prompt


def test_a_background_load_that_fails_is_prefilled(background, memory, synchronous):
    """vLLM recomputes the failed blocks and, asked again for the request, the connector claims
    nothing: the answer is plain prefill's, the client is told load_error (on a GPU the product's
    policy ends the request with an error instead: compat.load_failure_policy)."""
    params, salt, prompt = corrupt_memory(memory, "carol")
    rec.WRITES.clear()
    tokens, out = run_steps(background, prompt, params, salt)
    assert [kind for kind, _ in rec.WRITES] == ["background"]  # loaded once, not again after the failure
    if compat.load_failure_policy() == "fail":
        assert out.outputs[0].finish_reason == "error"
    else:
        assert report(out) == {"injected_tokens": 0, "recomputed_tokens": 0, "fallback": "load_error"}
        assert tokens == synchronous[1]["alice"]
    assert_nothing_left(background)


@pytest.mark.skipif(compat.load_failure_policy() == "recompute", reason="the product's policy here: tested above")
def test_a_failed_background_load_is_recomputed_right_under_the_recompute_policy(memory, synchronous):
    """Where the product ends a request whose load failed with an error (a GPU: vLLM's V2 model
    runner answers a request rolled back after it ran with wrong tokens, vllm-project/vllm#49250),
    a background load fails before its request ever ran: under "recompute" it must answer as
    plain prefill. (What a "recompute" policy for background loads would rest on.)"""
    llm = engine(memory, "always", load_failure_policy="recompute")
    try:
        params, salt, prompt = corrupt_memory(memory, "dave")
        tokens, out = run_steps(llm, prompt, params, salt)
        assert vh.report(out)["fallback"] == "load_error"
        assert tokens == synchronous[1]["alice"]
        assert_nothing_left(llm)
    finally:
        vh.close_engine(llm)


def test_a_step_loads_its_first_requests_before_the_forward_pass_and_the_rest_beside_the_batch(memory, synchronous):
    """[tuning] before_forward_tokens: of a step's requests, those whose loads fit the budget are
    written before its forward pass and the rest beside the batch; every answer as before. (A
    request for memory a request before it in the step loads before the forward pass finds it in
    vLLM's prefix cache, the same salt: nothing to load.)"""
    _, data, memory_of = memory
    alone, _ = synchronous
    users = ["alice", "bob", "alice", "bob"]
    alice, bob = (len(memory_of[user][0][1]) for user in ("alice", "bob"))
    llm = engine(memory, "auto")  # on a CPU "auto" loads before the forward pass: a GPU's mode, set here
    try:
        rec.SIDES["scheduler"].load_mode = LoadMode(True, lone_before_forward=True,
                                                    before_forward_tokens=alice + min(alice, bob) // 2)
        got = answers(llm, data, memory_of, users)
        assert [tokens for tokens, _, _ in got] == [alone[user][0] for user in users]
        segments = [alice, bob, alice, bob]
        assert all(report["injected_tokens"] == n or (report["injected_tokens"] == 0 and cached >= n)
                   for (_, report, cached), n in zip(got, segments)), got
        before = [ids for kind, ids in rec.WRITES if kind == "before"]
        beside = [ids for kind, ids in rec.WRITES if kind == "background"]
        assert before and all(len(ids) == 1 for ids in before), rec.WRITES  # never past the budget in a step
        assert beside, rec.WRITES  # bob's memory, past it
        assert_nothing_left(llm)
    finally:
        vh.close_engine(llm)
