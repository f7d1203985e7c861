"""Nothing of a deleted fact or a forgotten user is readable from vLLM's prefix cache under any
salt, by default, through a live `inferscale serve` (tiny Qwen2, CPU): the request the server
made for the memory (its token ids, its salt: a leaked salt), sent to the engine again after the
delete, is refused at the port without the engine key, which only the front holds, and the front
never sends an old salt. vLLM's dev routes stay off. With --forget-resets-prefix-cache the blocks
themselves go too (the lock's own route), after a fact delete as after a forget."""

from __future__ import annotations

import httpx
import pytest

import tiny_models
from inferscale.api import Context, GenerationAPI
from inferscale.config import Config
from vllm_server import inferscale_serve

pytestmark = pytest.mark.slow
FACTS = [f"Erin's note {i}: the locker code is {1000 + i}." for i in range(12)]


def _serve(tmp_path_factory, *args):
    model = tiny_models.tiny_model_dir("qwen2", "float32")
    data = tmp_path_factory.mktemp("erasure")
    return inferscale_serve(model, data, "--max-model-len", "2048", "--enable-prompt-tokens-details", *args)


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    with _serve(tmp_path_factory) as running:
        yield running


@pytest.fixture(scope="module")
def resetting_front(tmp_path_factory):
    with _serve(tmp_path_factory, "--forget-resets-prefix-cache") as running:
        yield running


class Leaked:
    """The server's own request for a user's memory, kept by someone who reaches the engine port."""

    def __init__(self, front, user: str):
        generation = GenerationAPI(Context(Config.from_dict({"model": str(tiny_models.tiny_model_dir("qwen2", "float32")),
                                                             "data_dir": str(front.data_dir)})))
        ids = [f.fact_id for f in generation.context.record.facts(user).values()]
        request = generation.prompt(user, "What is my locker code?", ids)
        self.front, self.ids = front, ids
        self.engine = f"http://127.0.0.1:{front.engine_port()}"
        model = httpx.get(f"{self.engine}/v1/models").json()["data"][0]["id"]
        self.body = {"model": model, "prompt": request.prompt["prompt_token_ids"], "max_tokens": 1,
                     "cache_salt": request.prompt["cache_salt"], "kv_transfer_params": request.kv_transfer_params,
                     "temperature": 0}

    def send(self, key: bool) -> httpx.Response:
        headers = self.front.engine_headers() if key else {}
        return httpx.post(f"{self.engine}/v1/completions", json=self.body, headers=headers, timeout=120)

    def cached_tokens(self) -> int:
        usage = self.send(key=True).json()["usage"]
        return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _add(front, user: str) -> None:
    added = httpx.post(f"{front.url}/v1/memories", json={"user_id": user, "facts": FACTS}, timeout=300)
    assert added.status_code == 201, added.text


def _cached_now(leaked: Leaked) -> None:
    leaked.cached_tokens()
    assert leaked.cached_tokens() >= 16  # control: the memory's blocks are in vLLM's prefix cache


def test_a_forgotten_users_leaked_request_is_refused_at_the_engine_port(front):
    _add(front, "erin@example.com")
    leaked = Leaked(front, "erin@example.com")
    _cached_now(leaked)
    assert httpx.delete(f"{front.url}/v1/memories", params={"user_id": "erin@example.com"}).status_code == 200
    refused = leaked.send(key=False)
    assert refused.status_code == 401 and "choices" not in refused.text, refused.text


def test_a_deleted_facts_leaked_request_is_refused_at_the_engine_port(front):
    _add(front, "finn@example.com")
    leaked = Leaked(front, "finn@example.com")
    _cached_now(leaked)
    gone = httpx.delete(f"{front.url}/v1/memories/{leaked.ids[0]}", params={"user_id": "finn@example.com"})
    assert gone.status_code == 200 and "prefix_cache_reset" not in gone.json(), gone.text
    assert leaked.send(key=False).status_code == 401


def test_the_front_sends_no_client_salt_and_vllms_dev_routes_are_off(front):
    salted = httpx.post(f"{front.url}/v1/completions", json={"model": "qwen2-float32", "prompt": [1, 2, 3],
                                                             "cache_salt": "inferscale-" + "0" * 32})
    assert salted.status_code == 400
    engine = f"http://127.0.0.1:{front.engine_port()}"
    for method, path in (("GET", "/server_info"), ("POST", "/collective_rpc"), ("POST", "/sleep"),
                         ("POST", "/reset_prefix_cache")):
        assert httpx.request(method, f"{engine}{path}").status_code == 401, path
        assert httpx.request(method, f"{engine}{path}", headers=front.engine_headers()).status_code == 404, path
    assert httpx.get(f"{engine}/health").status_code == 200  # the front's and routers' probe stays open


def test_with_the_flag_a_fact_delete_and_a_forget_empty_the_prefix_cache(resetting_front):
    front = resetting_front
    _add(front, "gus@example.com")
    leaked = Leaked(front, "gus@example.com")
    _cached_now(leaked)
    gone = httpx.delete(f"{front.url}/v1/memories/{leaked.ids[0]}", params={"user_id": "gus@example.com"})
    assert gone.status_code == 200 and gone.json()["prefix_cache_reset"] is True, gone.text
    assert leaked.cached_tokens() == 0  # even with the key: the blocks are gone
    _cached_now(Leaked(front, "gus@example.com"))
    forgotten = httpx.delete(f"{front.url}/v1/memories", params={"user_id": "gus@example.com"})
    assert forgotten.status_code == 200 and forgotten.json()["prefix_cache_reset"] is True
    assert leaked.cached_tokens() == 0
    for method, path in (("GET", "/server_info"), ("POST", "/collective_rpc"), ("POST", "/sleep")):  # no dev mode
        assert httpx.request(method, f"{leaked.engine}{path}", headers=front.engine_headers()).status_code == 404


def test_the_model_list_through_the_front_names_no_path(front):
    answer = httpx.get(f"{front.url}/v1/models", timeout=30)
    model = tiny_models.tiny_model_dir("qwen2", "float32")
    assert answer.status_code == 200 and answer.json()["data"][0]["id"] == model.name
    assert str(model.parent) not in answer.text, answer.text
