"""In process (``inferscale.api``, the tiny Qwen2 behind the facade): once a fact is deleted or
changed, or the user forgotten, the request the library made for that memory (its salt included),
sent to the engine again, reads nothing from vLLM's prefix cache."""

from __future__ import annotations

import pytest

import vllm_harness as vh
from test_api_isolation import REFUSED, add_user, send, server_request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mem(tmp_path_factory):
    """The facade engine shared with test_api.py and test_api_isolation.py; users here are disjoint."""
    return vh.facade(tmp_path_factory)


def _cached(mem, request) -> int:
    send(mem, request)
    return send(mem, request)[2].num_cached_tokens


@pytest.mark.parametrize("erase", ["delete_user", "delete_fact", "update_fact"])
def test_an_erased_memorys_old_request_reads_nothing_from_the_prefix_cache(mem, erase):
    user = f"lib-{erase.replace('_', '-')}"
    fact_ids = add_user(mem, user)
    leaked = server_request(mem, user)
    assert _cached(mem, leaked) >= 16  # control: the memory's blocks are cached under its salt
    if erase == "delete_user":
        mem.memory.delete_user(user)
    elif erase == "delete_fact":
        mem.memory.delete_fact(user, fact_ids[0])
    else:
        mem.memory.update_fact(user, fact_ids[0], "The notebook is gone.")
    _, _, out = send(mem, leaked)
    assert out.num_cached_tokens == 0 and vh.report(out) == REFUSED
