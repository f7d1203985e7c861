"""Two replicas behind vllm-router with memory on a real Redis: the real pieces on one machine
(deploy/local_cluster.py: redis-server, two `inferscale engine` replicas of the tiny Qwen2,
vllm-router with consistent hashing on the session key, two `inferscale serve --engine-url`
fronts). A user added through one front answers from memory through the other; a delete
through one is honoured by the other; killing a replica mid-load loses no committed fact,
fails no chat and shows no user another's facts; Redis down means plain prefill and loud writes."""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

import tiny_models
from cluster_setup import LocalCluster  # skips the module without redis-server or the cluster extra

pytestmark = pytest.mark.slow

USERS = {f"user{i}@example.com": [f"User {i} has a pet called {name}.", f"User {i} was born in {city}."]
         for i, (name, city) in enumerate([("Miso", "Lisbon"), ("Rex", "Oslo"), ("Kiwi", "Lima"), ("Bolt", "Kyiv")])}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(tiny_models.tiny_model_dir("qwen2", "float32"))
    with LocalCluster(model, replicas=2, fronts=2, directory=tmp_path_factory.mktemp("cluster")) as running:
        running.model_name = Path(model).name
        yield running


def chat(cluster, front: str, user: str, question: str = "Where was I born?") -> dict:
    body = {"model": cluster.model_name, "user": user, "temperature": 0, "max_tokens": 4,
            "messages": [{"role": "user", "content": question}]}
    response = httpx.post(front + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["inferscale"]


def add(front: str, user: str, facts: list[str]) -> list[str]:
    response = httpx.post(front + "/v1/memories", json={"user_id": user, "facts": facts}, timeout=120)
    assert response.status_code == 201, response.text
    return [r["id"] for r in response.json()["results"]]


def listed(front: str, user: str) -> dict[str, str]:
    response = httpx.get(front + "/v1/memories", params={"user_id": user}, timeout=30)
    return {r["id"]: r["text"] for r in response.json()["results"]} if response.status_code == 200 else {}


def store_hits(url: str) -> dict[str, float]:
    """A replica's connector hits by tier: pinned (the user was hot) or redis (faulted in)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["tier"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "vllm:inferscale_store_hits_total"}


def served(url: str) -> float:
    """Requests a replica finished (vLLM's own counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:request_success_total")


def injected(info: dict) -> bool:
    """Answered with memory the connector wrote into the cache."""
    return from_memory(info) and info["report"]["injected_tokens"] > 0


def from_memory(info: dict) -> bool:
    """Answered with the user's memory as K/V: injected, or found in vLLM's prefix cache (a question
    asked before: nothing left to inject)."""
    report = info.get("report") or {}
    return info["mode"] == "kv" and "fallback" in report and report["fallback"] is None and bool(info["fact_ids"])


def wait_until(condition, limit_s: float = 300.0) -> None:
    """Poll ``condition`` until it holds; ``limit_s`` only stops a hung run (the test then fails
    on what did not happen, not on how long it took)."""
    deadline = time.monotonic() + limit_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.2)


def test_a_user_added_on_one_front_answers_from_memory_on_the_other_and_a_delete_holds_everywhere(cluster):
    front_a, front_b = cluster.front_urls
    ids = {user: add(front_a, user, facts) for user, facts in USERS.items()}
    for user in USERS:
        info = chat(cluster, front_b, user)
        assert injected(info), info
        assert set(info["fact_ids"]) <= set(ids[user])
    gone = ids["user0@example.com"][1]
    response = httpx.delete(f"{front_b}/v1/memories/{gone}", params={"user_id": "user0@example.com"}, timeout=30)
    assert response.status_code == 200, response.text
    assert gone not in listed(front_a, "user0@example.com")
    info = chat(cluster, front_a, "user0@example.com")
    assert injected(info) and info["fact_ids"] == [ids["user0@example.com"][0]], info
    found = httpx.post(front_a + "/v1/memories/search", json={"user_id": "user0@example.com", "query": "born"},
                       timeout=30).json()
    assert gone not in [r["id"] for r in found["results"]]


def test_the_session_key_keeps_a_user_on_one_replica_and_carries_no_user_id(cluster):
    front_a, front_b = cluster.front_urls
    before = {url: (served(url), store_hits(url).get("redis", 0)) for url in cluster.replica_urls}
    for front, question in itertools.product((front_a, front_b), ("Where was I born?", "What is my pet called?")):
        chat(cluster, front, "user1@example.com", question)
    after = {url: (served(url), store_hits(url).get("redis", 0)) for url in cluster.replica_urls}
    grew = [url for url in cluster.replica_urls if after[url][0] > before[url][0]]
    assert len(grew) == 1  # one replica served all four, through either front
    assert after[grew[0]][1] == before[grew[0]][1]  # and found the user hot: nothing faulted in from Redis
    assert "user1@example.com" not in cluster.started["router"].log_text()


def test_killing_a_replica_mid_load_fails_no_chat_loses_no_fact_and_leaks_nothing(cluster):
    front_a, front_b = cluster.front_urls
    own = {user: set(listed(front_a, user)) for user in USERS}
    held = {url: served(url) for url in cluster.replica_urls}
    victim = cluster.replica(max(held, key=held.get))
    survivor = next(url for url in cluster.replica_urls if url != victim.url)
    problems, answers, committed = [], [], []
    stop = threading.Event()

    def chats(front: str):
        for user in itertools.cycle(USERS):
            if stop.is_set():
                return
            try:
                asked = time.monotonic()
                info = chat(cluster, front, user)
                answers.append((asked, user, info))
                if not set(info["fact_ids"]) <= own[user] | (set(committed) if user == "user3@example.com" else set()):
                    problems.append(f"{user} was shown {info['fact_ids']}")
            except Exception as exc:  # noqa: BLE001  (every failure is a problem to report)
                problems.append(f"chat for {user}: {exc}")

    def writes():
        for i in itertools.count():
            if stop.is_set():
                return
            try:
                committed.extend(add(front_b, "user3@example.com", [f"User 3 bought item number {i}."]))
            except Exception as exc:  # noqa: BLE001
                problems.append(f"write {i}: {exc}")

    threads = [threading.Thread(target=chats, args=(f,)) for f in (front_a, front_b)] + [threading.Thread(target=writes)]
    for thread in threads:
        thread.start()
    wait_until(lambda: problems or len(answers) >= 4 and committed)  # the load under way: chats answered, a write
    victim.kill(signal.SIGKILL)
    killed = time.monotonic()

    def asked_after_the_kill() -> list[tuple[str, dict]]:
        return [(user, info) for asked, user, info in list(answers) if asked > killed]

    def answered_after_the_kill() -> Counter:
        return Counter(user for user, _ in asked_after_the_kill())

    wait_until(lambda: problems or all(answered_after_the_kill()[user] >= 2 for user in USERS))
    stop.set()
    for thread in threads:
        thread.join(timeout=150)
    assert not problems, problems[:5]
    after = asked_after_the_kill()
    # user3's memory changes under the load: a chat composed just before a write carries the old epoch's
    # salt, which the replica refuses ("refused"), or was planned on the old epoch and finds the new one
    # loaded ("load_error"); either way vLLM prefills the facts in its prompt instead: no stale K/V
    settled = [info for user, info in after if user != "user3@example.com"]
    assert all(from_memory(info) for info in settled), [i for i in settled if not from_memory(i)][:3]
    assert all(info["report"]["fallback"] in (None, "refused", "load_error") for _, info in after)
    # answers keep coming: every user, the killed replica's too, answered again (from the survivor)
    assert all(answered_after_the_kill()[user] >= 2 for user in USERS), answered_after_the_kill()
    assert store_hits(survivor).get("redis", 0) >= 1
    assert set(committed) <= set(listed(front_a, "user3@example.com"))  # no committed fact lost


def test_with_redis_down_chats_fall_back_to_plain_prefill_and_writes_fail_loudly(cluster):
    front_a, front_b = cluster.front_urls
    before = listed(front_a, "user2@example.com")
    port = int(cluster.redis_url.rsplit(":", 1)[1].split("/")[0])
    cluster.started["redis"].kill(signal.SIGKILL)
    info = chat(cluster, front_b, "user2@example.com")
    assert info["mode"] == "none" and info["fallback"] == "store_unavailable" and info["fact_ids"] == []
    response = httpx.post(front_a + "/v1/memories", json={"user_id": "user2@example.com", "facts": ["Lost."]},
                          timeout=60)
    assert response.status_code == 503 and "store_unavailable" in response.text, response.text
    cluster.start_redis(port)  # its append-only file brings back what was committed
    assert listed(front_a, "user2@example.com") == before
    assert from_memory(chat(cluster, front_b, "user2@example.com"))
