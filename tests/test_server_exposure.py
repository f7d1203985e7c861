"""What a live `inferscale serve` exposes, probed as an attacker would (tiny Qwen2, CPU, loopback).

One server for the module: vLLM's admin routes stay out of reach through the front however
the path is encoded; ``/metrics`` tells a forged request's outcomes apart by nothing and
shows no path; reserved fields are refused wherever they hide, duplicate keys too, and no
fuzzed body gets a 5xx; a huge id is refused for its length; one large add does not hold other
users' writes; a corrupt index costs its user alone; a forgotten user's K/V leaves vLLM's
prefix cache.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tiny_models
from vllm_server import inferscale_serve

pytestmark = pytest.mark.slow
MAYA = "maya@example.com"
MODEL = "qwen2-float32"  # the name the tiny model's directory is served under
FACTS = ["Maya has a grey cat called Pixel.", "Maya is allergic to peanuts.", "Maya's sister Ana lives in Porto."]
#: vLLM's routes outside the OpenAI API (both supported releases; dev mode adds the second half)
ADMIN_ROUTES = ("load", "openapi.json", "docs", "redoc", "scale_elastic_ep", "is_scaling_elastic_ep",
                "is_sleeping", "ping", "server_info", "metrics", "health", "reset_prefix_cache", "reset_mm_cache",
                "sleep", "wake_up", "collective_rpc", "start_profile", "stop_profile", "update_weights",
                "v1/load_lora_adapter", "v1/unload_lora_adapter", "invocations", "pause", "resume")
#: ways to write "the engine's /<route>" from under /v1
ENCODINGS = ("/v1/../{}", "/v1/%2e%2e/{}", "/v1/..%2F{}", "/v1/%2E%2E%2F{}", "/v1/.%2e/{}", "/v1/%252e%252e/{}",
             "/v1/models/../../{}", "/v1//../{}", "/v1/./../{}", "/{}")


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    model = tiny_models.tiny_model_dir("qwen2", "float32")
    data = tmp_path_factory.mktemp("exposed")
    with inferscale_serve(model, data, "--forget-resets-prefix-cache", "--max-model-len", "2048",
                          "--enable-prompt-tokens-details") as front:
        front.data, front.model = data, model
        added = httpx.post(f"{front.url}/v1/memories", json={"user_id": MAYA, "facts": FACTS}, timeout=300)
        assert added.status_code == 201, added.text
        yield front


def raw_request(front, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """A request whose path goes out exactly as written (httpx would resolve its dot-segments)."""
    host, port = front.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def engine_url(front) -> str:
    children = open(f"/proc/{front.proc.pid}/task/{front.proc.pid}/children").read().split()
    (engine,) = [int(pid) for pid in children]
    cmd = open(f"/proc/{engine}/cmdline").read().split("\0")
    return f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"


def chat_body(user: str = MAYA, **extra) -> dict:
    return {"model": MODEL, "user": user, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": "What is my cat called?"}], **extra}


# ---------------------------------------------------------------- 1. the passthrough


def test_the_engines_admin_routes_are_not_reachable_through_the_front(front):
    reached = {}
    for route in ADMIN_ROUTES:
        for encoding in ENCODINGS:
            path = encoding.format(route)
            for method, body in (("GET", b""), ("POST", b'{"new_data_parallel_size": 2}')):
                status, answer = raw_request(front, method, path, body)
                if route in ("metrics", "health") and encoding == "/{}":
                    continue  # the front's own
                if status != 404 or b"no route" not in answer:
                    reached[f"{method} {path}"] = (status, answer[:80])
    assert not reached, reached
    assert raw_request(front, "GET", "/v1/models")[0] == 200  # the OpenAI API still passes
    assert raw_request(front, "GET", "/v1/./models")[0] == 200  # normalized, then matched
    assert httpx.get(f"{engine_url(front)}/load").status_code == 200  # the route exists, on the engine


def test_the_engines_openai_routes_pass_through_the_front_with_their_method_only(front):
    """The allow side: each listed route gets the engine's own answer through the front (the
    same status as asked of the engine directly, never the front's "no route"), and the same
    route with another method is the front's 404."""
    engine = engine_url(front)
    tokens = httpx.post(f"{front.url}/tokenize", json={"model": MODEL, "prompt": "Hello there"}, timeout=60)
    assert tokens.status_code == 200 and tokens.json()["tokens"], tokens.text[:200]
    text = httpx.post(f"{front.url}/detokenize", json={"model": MODEL, "tokens": tokens.json()["tokens"]}, timeout=60)
    assert text.status_code == 200 and text.json()["prompt"] == "Hello there", text.text[:200]
    calls = [("GET", "/version", None), ("GET", "/v1/models", None),
             ("POST", "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0}),
             ("POST", "/v1/embeddings", {"model": MODEL, "input": "Hi"})]
    for method, path, body in calls:
        through = httpx.request(method, f"{front.url}{path}", json=body, timeout=60)
        direct = httpx.request(method, f"{engine}{path}", json=body, headers=front.engine_headers(), timeout=60)
        assert through.status_code == direct.status_code and b"no route" not in through.content, (path, through.text)
    assert httpx.get(f"{front.url}/version").json() == httpx.get(f"{engine}/version").json()
    for method, path in (("GET", "/tokenize"), ("GET", "/detokenize"), ("GET", "/v1/completions"),
                         ("GET", "/v1/embeddings"), ("POST", "/version"), ("DELETE", "/v1/models")):
        status, answer = raw_request(front, method, path, b"{}" if method == "POST" else b"")
        assert status == 404 and b"no route" in answer, (method, path, status, answer[:100])


# ---------------------------------------------------------------- 2. /metrics


def test_metrics_do_not_tell_a_forged_requests_outcomes_apart_and_show_no_path(front):
    """A client of the engine port forges memory requests: an unknown user, an unknown fact,
    Maya's right facts without the salt. Each is refused alike, and the fallback counters on
    /metrics move the same way for all three: one coarse reason."""
    maya = [f["id"] for f in httpx.get(f"{front.url}/v1/memories", params={"user_id": MAYA}).json()["results"]]
    engine = engine_url(front)
    model = httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]
    forged = {"unknown user": {"user_id": "nobody", "fact_ids": maya}, "unknown fact": {"user_id": MAYA,
              "fact_ids": ["f-0123456789abcdef"]}, "right facts": {"user_id": MAYA, "fact_ids": maya}}
    before = fallbacks(httpx.get(f"{front.url}/metrics").text)
    moved = {}
    for name, params in forged.items():
        answer = httpx.post(f"{engine}/v1/completions", json={"model": model, "prompt": [1, 2, 3, 4],
                            "max_tokens": 1, "kv_transfer_params": {"inferscale": params}},
                            headers=front.engine_headers(), timeout=60)
        assert answer.json()["kv_transfer_params"]["inferscale"]["fallback"] == "refused", name
        now = fallbacks(wait_for_metrics(front, sum(before.values()) + 1))
        moved[name] = {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}
        before = now
    assert moved == {name: {"refused": 1} for name in forged}, moved
    text = httpx.get(f"{front.url}/metrics").text
    names = set(re.findall(r'model_name="([^"]*)"', text))
    assert names == {front.model.name}, names  # the directory's name, not its path
    paths = {v for k, v in re.findall(r'(\w+)="(/[^"]*)"', text) if k != "handler"}  # handler: an HTTP route
    assert not paths and str(front.model.parent) not in text and str(front.data) not in text, sorted(paths)[:5]


def fallbacks(text: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        if line.startswith("vllm:inferscale_fallbacks_total{"):
            reason = re.search(r'reason="([^"]*)"', line).group(1)
            found[reason] = found.get(reason, 0) + float(line.rsplit(" ", 1)[1])
    return found


def wait_for_metrics(front, total: float, timeout_s: float = 15) -> str:
    """The engine's counters reach /metrics on its next stats interval."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{front.url}/metrics").text
        if sum(fallbacks(text).values()) >= total or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


# ---------------------------------------------------------------- 3. strict parsing


def test_reserved_fields_are_refused_wherever_they_hide(front):
    v1 = f"{front.url}/v1"
    params = {"inferscale": {"user_id": MAYA, "fact_ids": []}}
    tries = {
        "xargs list, kv chat": ("chat/completions", chat_body(vllm_xargs={"kv_transfer_params": [1, 2]})),
        "xargs params, text chat": ("chat/completions", chat_body(vllm_xargs={"kv_transfer_params": params},
                                                                  inferscale={"mode": "text"})),
        "xargs salt, kv chat": ("chat/completions", chat_body(vllm_xargs={"cache_salt": "inferscale-0"})),
        "xargs not an object": ("chat/completions", chat_body(vllm_xargs=[1])),
        "xargs params, no user": ("chat/completions", chat_body(user=None, vllm_xargs={"kv_transfer_params": params})),
        "xargs params, completions": ("completions", {"model": "x", "prompt": "Hi", "max_tokens": 1,
                                                      "vllm_xargs": {"kv_transfer_params": params}}),
        "params as null": ("completions", {"model": "x", "prompt": "Hi", "max_tokens": 1, "kv_transfer_params": None}),
    }
    answers = {name: httpx.post(f"{v1}/{path}", json=body, timeout=60) for name, (path, body) in tries.items()}
    assert {name: a.status_code for name, a in answers.items()} == {name: 400 for name in tries}
    assert all(a.json()["error"]["message"] for a in answers.values())


def test_a_key_given_twice_is_refused_on_every_route(front):
    v1 = f"{front.url}/v1"
    twice = {
        "chat": ("chat/completions", '{"user": "%s", "kv_transfer_params": {"inferscale": {}}, '
                                     '"kv_transfer_params": null, "messages": [{"role": "user", "content": "hi"}]}'
                 % MAYA),
        "completions": ("completions", '{"prompt": "Hi", "kv_transfer_params": {"a": 1}, "kv_transfer_params": null}'),
        "memories": ("memories", '{"user_id": "a", "user_id": "b", "facts": ["x"]}'),
        "search": ("memories/search", '{"user_id": "%s", "query": "cat", "query": "dog"}' % MAYA),
    }
    for name, (path, body) in twice.items():
        answer = httpx.post(f"{v1}/{path}", content=body.encode(), headers={"Content-Type": "application/json"})
        assert answer.status_code == 400 and "twice" in answer.json()["error"]["message"], (name, answer.text)


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                       | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
                       lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)
CHAT_KEYS = ("model", "user", "messages", "inferscale", "stream", "temperature", "max_tokens", "n", "stop",
             "seed", "top_p", "vllm_xargs", "kv_transfer_params", "cache_salt", "tools", "prompt", "logprobs")
MEMORY_KEYS = ("user_id", "facts", "messages", "query", "k", "text")


def _fuzzed(keys: tuple[str, ...], base: dict):
    fields = st.dictionaries(st.sampled_from(keys), JSONISH, max_size=4)
    inner = st.fixed_dictionaries({"mode": st.sampled_from(["kv", "text", "none", 3, None]), "k": JSONISH})
    return st.builds(lambda f, o: {**base, **f, **({"inferscale": o} if "inferscale" not in f else {})}, fields,
                     inner)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=_fuzzed(CHAT_KEYS, chat_body()))
def test_no_fuzzed_chat_gets_a_5xx(front, body):
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code < 500, (body, answer.text[:300])
    if answer.status_code >= 400:
        assert answer.json()["error"]["message"], body


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(body=_fuzzed(MEMORY_KEYS, {"user_id": "fuzz"}), path=st.sampled_from(["memories", "memories/search"]))
def test_no_fuzzed_memory_request_gets_a_5xx(front, body, path):
    body.pop("inferscale", None)
    answer = httpx.post(f"{front.url}/v1/{path}", json=body, timeout=120)
    assert answer.status_code < 500, (body, answer.text[:300])


# ---------------------------------------------------------------- 4. limits that protect bystanders


def test_a_huge_user_id_is_refused_for_its_size_and_others_are_answered_meanwhile(front):
    """A 30 MB id is refused by the route's body cap, before the body is parsed (the answer names
    the cap and does not echo the id); another client's requests keep being answered, 200, while
    each huge one is in flight. How long either takes is measured by benchmarks, not here."""
    huge = "u" * (30 << 20)
    statuses, stop = [], threading.Event()

    def bystander():
        while not stop.is_set():
            statuses.append(httpx.get(f"{front.url}/v1/users", timeout=60).status_code)

    watcher = threading.Thread(target=bystander)
    watcher.start()
    try:
        for path, body in (("memories", {"user_id": huge, "facts": ["x"]}), ("chat/completions", chat_body(huge)),
                           ("memories/search", {"user_id": huge, "query": "x"})):
            content = json.dumps(body).encode()  # encoded before: what is in flight is the front's work
            answer = httpx.post(f"{front.url}/v1/{path}", content=content, timeout=120,
                                headers={"Content-Type": "application/json"})
            assert answer.status_code == 413 and len(answer.content) < 2000, (path, answer.text[:200])  # over the cap
            message = answer.json()["error"]["message"]
            assert re.search(r"larger than \d+ [KM]iB", message) and "uuu" not in message, (path, message)
    finally:
        stop.set()
        watcher.join()
    assert statuses and set(statuses) == {200}, statuses


def test_one_large_add_does_not_hold_another_users_small_add(front):
    """A small add asked while a large one is being written (its first chunk stored) is stored
    between two of the large add's chunks: it ends first, with the large add still partly written."""
    big = [f"Fact {i} of the long list: " + "a long memory of many words " * 70 for i in range(12)]
    finished: list[str] = []

    def add(user: str, facts: list[str]) -> None:
        answer = httpx.post(f"{front.url}/v1/memories", json={"user_id": user, "facts": facts}, timeout=600)
        assert answer.status_code == 201, answer.text[:300]
        finished.append(user)

    def stored(user: str) -> list[str]:
        answer = httpx.get(f"{front.url}/v1/memories", params={"user_id": user}, timeout=60)
        return [f["text"] for f in answer.json()["results"]] if answer.status_code == 200 else []

    large = threading.Thread(target=add, args=("big-writer", big))
    large.start()
    while large.is_alive() and not stored("big-writer"):  # until the large add is under way
        time.sleep(0.05)
    add("small-writer", ["Sam likes tea."])
    partly = stored("big-writer")
    large.join()
    assert finished == ["small-writer", "big-writer"], finished
    assert 0 < len(partly) < len(big) and partly == big[: len(partly)], len(partly)  # chunks, in order
    assert stored("big-writer") == big  # in its order, whole


def test_a_call_over_the_fact_limits_is_refused(front):
    for facts in (["x"] * 257, ["y" * 2001], ["z" * 2000] * 51):
        answer = httpx.post(f"{front.url}/v1/memories", json={"user_id": "limits", "facts": facts})
        assert answer.status_code == 400 and answer.json()["error"]["message"], answer.text[:200]


# ---------------------------------------------------------------- 5. corrupt data


def test_a_corrupt_index_costs_its_user_alone(front):
    user = "broken"
    assert httpx.post(f"{front.url}/v1/memories", json={"user_id": user, "facts": ["Bo has a dog."]},
                      timeout=120).status_code == 201
    (front.data / "kv" / "users" / user / "index.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    answer = httpx.post(f"{front.url}/v1/chat/completions", json=chat_body(user), timeout=120)
    assert answer.status_code == 200 and answer.json()["inferscale"]["fallback"] == "unreadable_memory", answer.text
    engine = engine_url(front)
    model = httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]
    forged = httpx.post(f"{engine}/v1/completions", json={"model": model, "prompt": [1, 2, 3], "max_tokens": 1,
                        "kv_transfer_params": {"inferscale": {"user_id": user, "fact_ids": ["f-0"]}}},
                        headers=front.engine_headers(), timeout=60)
    assert forged.status_code == 200 and forged.json()["kv_transfer_params"]["inferscale"]["fallback"] == "refused"
    assert httpx.get(f"{front.url}/health").status_code == 200  # the engine lives
    maya = httpx.post(f"{front.url}/v1/chat/completions", json=chat_body(), timeout=120).json()["inferscale"]
    assert maya["report"]["fallback"] is None and maya["memory_tokens"] > 0  # injected, or cached from before
    gone = httpx.delete(f"{front.url}/v1/memories", params={"user_id": user})
    assert gone.status_code == 200, gone.text
    assert not (front.data / "kv" / "users" / user).exists()


# ---------------------------------------------------------------- 6. erasure


def test_a_forgotten_users_kv_is_not_served_from_vllms_prefix_cache(front):
    """The server's own request for a user (token ids, salt, params), sent to the engine again
    after the user is forgotten: nothing of it comes from the prefix cache any more."""
    from inferscale.api import Context, GenerationAPI
    from inferscale.config import Config

    user = "erased@example.com"
    facts = [f"Erin's note {i}: the locker code is {1000 + i}." for i in range(12)]
    added = httpx.post(f"{front.url}/v1/memories", json={"user_id": user, "facts": facts}, timeout=300)
    assert added.status_code == 201, added.text
    generation = GenerationAPI(Context(Config.from_dict({"model": str(front.model), "data_dir": str(front.data)})))
    ids = [f.fact_id for f in generation.context.disk.facts(user).values()]
    request = generation.prompt(user, "What is my locker code?", ids)
    engine = engine_url(front)
    model = httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": request.prompt["prompt_token_ids"], "cache_salt": request.prompt["cache_salt"],
            "kv_transfer_params": request.kv_transfer_params, "max_tokens": 1, "temperature": 0}

    def cached_tokens() -> int:
        usage = httpx.post(f"{engine}/v1/completions", json=body, headers=front.engine_headers(), timeout=120).json()["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    cached_tokens()
    assert cached_tokens() >= 16  # control: the second time, the memory's blocks come from the cache
    gone = httpx.delete(f"{front.url}/v1/memories", params={"user_id": user}, timeout=60)
    assert gone.status_code == 200 and gone.json()["prefix_cache_reset"] is True, gone.text
    assert cached_tokens() == 0
