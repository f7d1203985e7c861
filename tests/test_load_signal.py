"""The adaptive recompute tail: when the engine has room for it, and what the planner claims either way."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale.compose.blend import ADAPTIVE, AUTO_RECOMPUTE_TOKENS, Blend, injected_length
from inferscale.compose.request import make_params
from inferscale.compose.salt import CacheSalts
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
from inferscale.config import Config, Tuning
from inferscale.errors import ConfigError
from inferscale.inject.load_signal import EngineLoad
from inferscale.inject.planner import plan_request
from inferscale.inject.report import client_report
from inferscale.storage.disk import DiskStore

from small_store import ann_store

SALTS = CacheSalts(b"s" * 32)


# ---------------------------------------------------------------- the config


def test_adaptive_is_the_default_with_the_devices_budget_as_its_cap():
    for device, cap in AUTO_RECOMPUTE_TOKENS.items():
        assert Config().blend(device) == Blend(cap, 1.0, adaptive=True)
    assert Config().blend("cuda").recompute_tokens == 256
    assert Config(recompute_tokens="auto").blend("cuda") == Blend(256)  # the same cap, for every request
    assert Config(recompute_tokens=32).blend("cuda") == Blend(32)
    assert Config(recompute_tokens=ADAPTIVE).blend("tpu") == Blend(0, adaptive=True)  # no budget known: none


def test_a_budget_the_request_sets_is_fixed():
    adaptive = Blend(256, 1.0, adaptive=True)
    assert adaptive.override(None, None) == adaptive
    assert adaptive.override(64, None) == Blend(64)
    assert adaptive.override(None, 1.1) == Blend(256, 1.1, adaptive=True)


def test_the_thresholds_are_tuning():
    load = EngineLoad.from_tuning(Config(tuning={"tail_max_step_tokens": 7, "tail_max_waiting": 2}).tuning)
    assert (load.max_step_tokens, load.max_waiting) == (7, 2)
    for bad in ({"tail_max_step_tokens": -1}, {"tail_max_waiting": 1.5}, {"tail_max_waiting": True}):
        with pytest.raises(ConfigError):
            Tuning.parse(bad)


# ---------------------------------------------------------------- the load signal


def test_an_idle_engine_has_room():
    load = EngineLoad(max_step_tokens=64, max_waiting=0)
    load.arrived("r1")
    assert load.has_room("r1")  # however long its own question: it delays no one else


def test_a_queue_leaves_no_room_but_the_last_request_of_it_may_have_some():
    load = EngineLoad(max_step_tokens=64, max_waiting=0)
    for r in ("r1", "r2"):
        load.arrived(r)
    assert not load.has_room("r1") and load.waiting_besides("r1") == 1
    load.admitted("r1", 10)
    assert load.has_room("r2")  # nothing else waits; the step holds r1's 10 tokens
    load.admitted("r2", 10 + 50)  # r2 took a 50-token tail
    load.arrived("r3")
    assert not load.has_room("r3")  # 70 > 64: one tail a step, at this threshold


def test_requests_decoding_fill_the_step_until_they_finish():
    load = EngineLoad(max_step_tokens=64, max_waiting=0)
    load.step_built([f"d{i}" for i in range(60)])  # 60 requests decode in the next step
    load.arrived("new")
    load.admitted("other", 5)
    assert load.step_tokens() == 65 and not load.has_room("new")
    for i in range(10):
        load.finished(f"d{i}")
    assert load.has_room("new")
    load.step_built([])  # a step without them: the engine is idle again
    assert load.step_tokens() == 0


def test_a_request_is_alone_only_in_a_step_with_nothing_else_to_run():
    load = EngineLoad(max_step_tokens=64, max_waiting=0)
    load.arrived("r1")
    assert load.alone("r1")
    load.arrived("r2")
    assert not load.alone("r1") and not load.alone("r2")  # each would share the step with the other
    load.admitted("r1", 16)
    assert not load.alone("r2")
    load.admitted("r2", 16)
    load.step_built(["r2"])  # r2 decodes in the next step
    load.arrived("r3")
    assert not load.alone("r3")
    load.finished("r2")
    assert load.alone("r3")


def test_asking_changes_nothing():
    """vLLM may ask about a request twice: the answer is the same, and so is the state."""
    load = EngineLoad(max_step_tokens=64, max_waiting=0)
    load.arrived("a")
    load.arrived("b")
    before = (load.step_tokens(), load.waiting_besides("a"))
    assert [load.has_room("a") for _ in range(3)] == [False] * 3
    assert (load.step_tokens(), load.waiting_besides("a")) == before


EVENTS = st.lists(st.tuples(st.sampled_from(["arrive", "admit", "step", "finish"]), st.integers(0, 7),
                            st.integers(0, 300)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(events=EVENTS, ask=st.integers(0, 7), max_step=st.integers(0, 256), max_waiting=st.integers(0, 3))
def test_the_signal_matches_a_plain_model_of_the_scheduler(events, ask, max_step, max_waiting):
    """Whatever vLLM does in whatever order, the load is: requests waiting (arrived, neither admitted
    nor finished), one token per request of the last step still running, and the tokens of the
    requests admitted since; room is granted exactly when both stay within their thresholds."""
    load = EngineLoad(max_step, max_waiting)
    waiting, decoding, admitted = set(), set(), {}
    for event, r, tokens in events:
        rid = f"r{r}"
        if event == "arrive":
            load.arrived(rid)
            waiting.add(rid)
        elif event == "admit":
            load.admitted(rid, tokens, loaded=tokens // 3)
            waiting.discard(rid), decoding.discard(rid)
            admitted[rid] = tokens
        elif event == "step":
            load.step_built(set(admitted) | decoding)
            decoding, admitted = set(admitted) | decoding, {}
        else:
            load.finished(rid)
            waiting.discard(rid), decoding.discard(rid), admitted.pop(rid, None)
    step = len(decoding) + sum(admitted.values())
    others = len(waiting - {f"r{ask}"})
    assert load.step_tokens() == step and load.waiting_besides(f"r{ask}") == others
    assert load.has_room(f"r{ask}") == (others <= max_waiting and step <= max_step)
    busy = decoding - {f"r{ask}"} or any(tokens for other, tokens in admitted.items() if other != f"r{ask}")
    assert load.alone(f"r{ask}") == (not busy and not others)
    # the memory the step loads before its forward pass: that of the requests admitted since the last step
    assert load.loaded_before_forward(besides=f"r{ask}") == sum(
        tokens // 3 for other, tokens in admitted.items() if other != f"r{ask}")


# ---------------------------------------------------------------- the claim


@settings(max_examples=400, deadline=None)
@given(parts=st.lists(st.integers(1, 40), min_size=1, max_size=30), cap=st.integers(0, 600),
       adaptive=st.booleans(), room=st.booleans())
def test_the_claim_under_any_load(parts, cap, adaptive, room):
    """Never less than the prefix, never a partial fact, never a tail past the cap, and the whole
    memory when an adaptive budget meets a busy engine."""
    blend = Blend(cap, adaptive=adaptive)
    claim = injected_length(parts, blend.budget(room))
    total = sum(parts)
    assert parts[0] <= claim <= total
    assert claim in {sum(parts[:i]) for i in range(1, len(parts) + 1)}  # a fact boundary
    assert total - claim <= cap
    if adaptive and not room:
        assert claim == total
    if room or not adaptive:  # room, or a fixed budget: the same tail as a fixed budget of the cap
        assert claim == injected_length(parts, cap)


@pytest.fixture
def disk(tmp_path) -> DiskStore:
    return ann_store(tmp_path / "kv")


def _request(disk: DiskStore, recompute_tokens=None):
    order = ["a", "b", "c"]
    (prefix,) = disk.token_ids(SYSTEM_USER, [PREFIX_FACT])
    segment = [*prefix, *(t for ids in disk.token_ids("ann", order) for t in ids)]
    salt = SALTS.segment("ann", disk.epoch("ann"), segment, recompute_tokens)
    return segment + [7, 8, 9], make_params("ann", order, recompute_tokens), salt


def test_the_planner_leaves_the_tail_only_when_the_engine_has_room(disk):
    prompt, params, salt = _request(disk)
    adaptive = Blend(8, adaptive=True)
    idle = plan_request(disk, SALTS, prompt, params, salt, 0, adaptive, lambda: True)
    assert (idle.claim_len, idle.recomputed, idle.budget, idle.room) == (10, 8, 8, True)
    busy = plan_request(disk, SALTS, prompt, params, salt, 0, adaptive, lambda: False)
    assert (busy.claim_len, busy.num_external, busy.recomputed, busy.budget, busy.room) == (18, 18, 0, 0, False)
    assert client_report(None, busy.num_external, busy.recomputed, busy.budget, busy.room) == {
        "injected_tokens": 18, "recomputed_tokens": 0, "recompute_budget": 0, "engine_busy": True, "fallback": None}
    assert client_report(None, idle.num_external, idle.recomputed, idle.budget, idle.room)["engine_busy"] is False


def test_a_fixed_budget_ignores_the_load(disk):
    prompt, params, salt = _request(disk)
    plan = plan_request(disk, SALTS, prompt, params, salt, 0, Blend(8), lambda: pytest.fail("asked"))
    assert (plan.claim_len, plan.budget, plan.room) == (10, 8, None)
    # a request's own budget is fixed too, over an adaptive default
    prompt, params, salt = _request(disk, recompute_tokens=3)
    plan = plan_request(disk, SALTS, prompt, params, salt, 0, Blend(8, adaptive=True), lambda: False)
    assert (plan.claim_len, plan.budget, plan.room) == (15, 3, None)
    assert client_report(None, 15, 3, plan.budget, plan.room)["engine_busy"] is None


def test_a_refused_request_is_not_asked_about_load(disk):
    prompt, params, _ = _request(disk)
    plan = plan_request(disk, SALTS, prompt, params, "wrong", 0, Blend(8, adaptive=True),
                        lambda: pytest.fail("asked"))
    assert plan.fallback is not None and plan.num_external == 0
    assert client_report(plan.fallback, 0, 0, plan.budget, plan.room)["recompute_budget"] == 0
