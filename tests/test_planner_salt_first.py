"""A hand-built request (no ``epoch``/``segment_tokens`` in its params) has its salt checked before
the planner tells a stored user or fact from an unknown one: every forgery gets one reason, and
the store is read the same way for each (nothing on ``/metrics``' plan time to tell them apart)."""

from __future__ import annotations

import pytest
import torch

from inferscale.compose.request import make_params
from inferscale.compose.salt import CacheSalts
from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
from inferscale.inject.planner import plan_request
from inferscale.inject.report import Fallback
from inferscale.kv import FactKV
from inferscale.storage.disk import DiskStore

SALTS = CacheSalts(b"k" * 32)


def _fact(n: int, seed: int) -> FactKV:
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, 2, n, 2, 8), generator=gen)
    return FactKV(torch.randint(10, 1000, (n,), generator=gen).tolist(), kv[0], kv[1])


class Reads(DiskStore):
    """The real disk store, noting which of its readers the planner calls."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def epoch_token_ids(self, user_id, fact_ids):
        self.calls.append("epoch_token_ids")
        return super().epoch_token_ids(user_id, fact_ids)

    def stored_lengths(self, user_id, fact_ids):
        self.calls.append("stored_lengths")
        return super().stored_lengths(user_id, fact_ids)


@pytest.fixture
def store(tmp_path) -> Reads:
    disk = Reads(DiskStore.Options(root=str(tmp_path / "kv")))
    disk.put(SYSTEM_USER, {PREFIX_FACT: _fact(4, 0)})
    disk.put("ann", {"a": _fact(6, 1), "b": _fact(5, 2)})
    return disk


def _forged(store: Reads) -> dict[str, dict]:
    return {"unknown user": make_params("nobody", ["a", "b"]), "unknown fact": make_params("ann", ["a", "zz"]),
            "stored facts": make_params("ann", ["a", "b"])}


@pytest.mark.parametrize("salt", [None, "inferscale-" + "0" * 32, "x"])
def test_a_hand_built_request_with_a_forged_salt_gets_one_reason_whatever_exists(store, salt):
    prompt = list(range(10, 40))
    reasons = {name: plan_request(store, SALTS, prompt, params, salt, 0).fallback
               for name, params in _forged(store).items()}
    assert reasons == dict.fromkeys(reasons, Fallback.MISSING_CACHE_SALT), reasons


def test_the_store_is_read_alike_for_stored_and_unknown_ids_before_the_salt_is_checked(store):
    prompt = list(range(10, 40))
    calls = {}
    for name, params in _forged(store).items():
        store.calls.clear()
        plan_request(store, SALTS, prompt, params, "inferscale-" + "0" * 32, 0)
        calls[name] = list(store.calls)
    assert calls == dict.fromkeys(calls, ["stored_lengths", "stored_lengths"]), calls  # the prefix, the user


def test_a_hand_built_request_with_the_right_salt_still_injects(store):
    (prefix,) = store.token_ids(SYSTEM_USER, [PREFIX_FACT])
    segment = [*prefix, *(t for ids in store.token_ids("ann", ["a", "b"]) for t in ids)]
    salt = SALTS.segment("ann", store.epoch("ann"), segment)
    plan = plan_request(store, SALTS, segment + [1, 2, 3], make_params("ann", ["a", "b"]), salt, 0)
    assert plan.fallback is None and plan.claim_len > 0


def test_stored_lengths_stand_in_for_what_is_not_stored(store):
    epoch, lengths = store.stored_lengths("ann", ["a", "zz", "b"])
    assert epoch == store.epoch("ann") and lengths == [6, 0, 5]
    assert store.stored_lengths("nobody", ["a"]) == (None, [0])
