"""A client that reaches the engine port directly cannot read another user's memory.

Each test replays one way it could, against a real vLLM engine (CPU, tiny
Qwen2) behind the facade: the server side (``GenerationAPI.prompt``) builds the
legitimate requests; the "client" sends raw requests to the same engine with
whatever it can know or compute: user ids, fact ids, the prompt's token ids,
and the cache salt formula that was public before salts were keyed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import vllm_harness as vh
from inferscale.compose.request import make_params

pytestmark = pytest.mark.slow

FACTS = [
    "{name} keeps a green notebook of passwords in the top drawer.",
    "{name}'s bank is in Porto and the account ends in 4417.",
    "{name} is seeing a doctor about migraines every Thursday.",
    "{name}'s sister Ana lives on Rua das Flores in Porto.",
    "{name} is saving money for a sailing trip to the Azores.",
]
QUERY = "What do I keep in the top drawer?"
#: what the client is told about a request that got no memory, whatever the reason
REFUSED = {"injected_tokens": 0, "recomputed_tokens": 0, "recompute_budget": 0, "engine_busy": None,
           "fallback": "refused"}


@pytest.fixture(scope="module")
def mem(tmp_path_factory):
    """The facade engine shared with test_api.py (vllm_harness.facade); users here are disjoint."""
    return vh.facade(tmp_path_factory)


def add_user(mem, user: str, facts=FACTS, noisy: bool = False) -> list[str]:
    """Store ``facts`` (``{name}``: the user's) for ``user``; ``noisy`` replaces their K/V
    with wrong K/V (same tokens), so output computed from the injected blocks is recognisable."""
    ids = [f.fact_id for f in mem.memory.add_facts(user, [f.format(name=user.title()) for f in facts])]
    if noisy:
        disk = mem.context.record
        disk.put(user, {f: vh.noisy(kv) for f, kv in disk.load_user(user).items()})
    return ids


def server_request(mem, user: str, mode: str = "kv"):
    """The request the server builds for the user's question (all of their facts)."""
    order = [f.fact_id for f in mem.memory.list_facts(user)]
    return mem.generation.prompt(user, QUERY, order, mode=mode)


def send(mem, request_or_ids, params=None, salt=None):
    """Greedy tokens, logprobs and output of a raw request to the engine."""
    if not isinstance(request_or_ids, list):
        request = request_or_ids
        return vh.greedy(mem.generation.llm, request.prompt["prompt_token_ids"], request.kv_transfer_params,
                         request.prompt.get("cache_salt"), max_tokens=4)
    return vh.greedy(mem.generation.llm, request_or_ids, params, salt, max_tokens=4)


def public_salt(user: str, segment: list[int]) -> str:
    """The cache salt as a client could compute it before salts were keyed:
    sha256 over the user id and the segment's token ids."""
    digest = hashlib.sha256(user.encode())
    digest.update(b"\x00")
    digest.update(",".join(map(str, segment)).encode())
    return f"inferscale-{digest.hexdigest()[:32]}"


def guessed_salts(user: str, segment: list[int]) -> list[str]:
    return [public_salt(user, segment), "inferscale-" + "0" * 32, "text", user]


def segment_of(request) -> list[int]:
    return request.prompt["prompt_token_ids"][: request.memory_tokens]


def test_forged_params_with_known_ids_get_no_injection(mem):
    """Knowing a user id, their fact ids and even the exact prompt tokens is not enough."""
    fact_ids = add_user(mem, "dana")
    request = server_request(mem, "dana")
    ids, segment = request.prompt["prompt_token_ids"], segment_of(request)
    plain_tokens, _, _ = send(mem, ids)
    for salt in [*guessed_salts("dana", segment), None]:
        tokens, _, out = send(mem, ids, make_params("dana", fact_ids), salt)
        assert vh.report(out)["injected_tokens"] == 0 and tokens == plain_tokens, salt
        assert vh.report(out) == REFUSED, salt
    # control: the server's own request does get the memory injected
    _, _, out = send(mem, request)
    assert vh.report(out)["fallback"] is None and vh.report(out)["injected_tokens"] > 0


def _flip(path: Path, offset: int = 20) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))


def test_reports_reveal_nothing_about_users_facts_or_tokens(mem):
    """Every refused request gets the same report: no detail, no position, no path,
    so walking a mismatch position (or probing ids) learns nothing."""
    fact_ids = add_user(mem, "erin")
    other = add_user(mem, "finn", ["Finn plays the cello."])
    add_user(mem, "gus", ["Gus owns a red kayak."])
    for path in (mem.context.config.kv_path).rglob("*"):  # damage every file of gus
        if "gus" in path.name or "gus" in path.parent.name:
            if path.is_file():
                _flip(path)
    request = server_request(mem, "erin")
    ids, segment = request.prompt["prompt_token_ids"], segment_of(request)
    params, salt = make_params("erin", fact_ids), public_salt("erin", segment)
    probes = {f"mismatch at {i}": ([*ids[:i], (ids[i] + 1) % 1000, *ids[i + 1:]], params, salt)
              for i in (0, 3, len(segment) // 2, len(segment) - 1)}
    probes.update({
        "matching tokens, wrong salt": (ids, params, salt),
        "no salt": (ids, params, None),
        "prompt no longer than the memory": (segment, params, salt),
        "unknown user": (ids, make_params("nobody", fact_ids), salt),
        "unknown fact": (ids, make_params("erin", [*fact_ids[:-1], "f-0000000000000000"]), salt),
        "another user's fact": (ids, make_params("erin", [fact_ids[0], *other]), salt),
        "corrupt memory": (ids, make_params("gus", ["f-0000000000000000"]), salt),
    })
    reports = {name: vh.report(send(mem, *probe)[2]) for name, probe in probes.items()}
    assert all(report == REFUSED for report in reports.values()), reports
    shown = json.dumps(reports)
    assert str(mem.context.config.data_path) not in shown and "safetensors" not in shown


def test_plain_request_with_a_guessed_salt_misses_the_injected_blocks(mem):
    """Injected (here: deliberately wrong) K/V in vLLM's prefix cache is keyed by a
    salt no client can compute, so a plain request never reads it."""
    add_user(mem, "hana", noisy=True)
    request = server_request(mem, "hana")
    ids, segment = request.prompt["prompt_token_ids"], segment_of(request)
    _, plain_lp, _ = send(mem, ids)
    _, injected_lp, out = send(mem, request)
    assert vh.report(out)["injected_tokens"] > 0 and injected_lp != plain_lp  # wrong K/V shows in the output
    for salt in guessed_salts("hana", segment):
        _, lp, out = send(mem, ids, None, salt)
        assert lp == plain_lp, salt
        if salt == public_salt("hana", segment):  # first used here (generic salts may hit plain blocks)
            assert out.num_cached_tokens == 0


def test_deleted_user_leaves_nothing_to_read(mem):
    """After a user is deleted, no salt a client can compute reads their cached blocks,
    and a user re-created under the same id gets a new salt: the old blocks are never served."""
    add_user(mem, "ivo", noisy=True)
    before = server_request(mem, "ivo")
    ids, segment = before.prompt["prompt_token_ids"], segment_of(before)
    _, stale_lp, out = send(mem, before)  # wrong K/V injected and cached under ivo's salt
    assert vh.report(out)["injected_tokens"] > 0
    fact_ids = [f.fact_id for f in mem.memory.list_facts("ivo")]
    mem.memory.delete_user("ivo")
    _, plain_lp, _ = send(mem, ids)
    for salt in guessed_salts("ivo", segment):
        _, lp, out = send(mem, ids, make_params("ivo", fact_ids), salt)
        assert lp == plain_lp, salt
        if salt == public_salt("ivo", segment):
            assert out.num_cached_tokens == 0
        assert vh.report(out) == REFUSED, salt
    add_user(mem, "ivo")  # the same facts again, correct K/V
    after = server_request(mem, "ivo")
    assert after.prompt["prompt_token_ids"] == ids
    assert after.prompt["cache_salt"] != before.prompt["cache_salt"]
    _, lp, out = send(mem, after)
    report = vh.report(out)
    assert report["fallback"] is None
    assert report["injected_tokens"] + report["recomputed_tokens"] == after.memory_tokens  # injected afresh
    assert lp != stale_lp


def test_prompt_mode_users_do_not_share_the_prefix_cache(mem):
    """Two users whose prompts are token for token the same still get no cache hit
    from each other; each user's own repeat does."""
    for user in ("jan", "kim"):
        add_user(mem, user, ["Likes green tea in the morning.", "Walks a dog called Biscuit at noon."])
    jan, kim = server_request(mem, "jan", "prompt"), server_request(mem, "kim", "prompt")
    assert jan.prompt["prompt_token_ids"] == kim.prompt["prompt_token_ids"]
    send(mem, jan)
    assert send(mem, jan)[2].num_cached_tokens > 0  # control: the prefix cache works within a user
    assert send(mem, kim)[2].num_cached_tokens == 0
    assert jan.prompt["cache_salt"] != kim.prompt["cache_salt"]
