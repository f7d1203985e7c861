"""The cluster path (deploy/local_cluster.py: redis-server, two `inferscale engine` replicas of the
tiny Qwen2, vllm-router, one front): a replica answers only the engine key, which the front sends
through the router (a leaked salt is of no use at a replica's port); a front's /health stays 200,
listing each replica, while one replica is up, and is 503 when none is."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

import tiny_models
from cluster_setup import LocalCluster  # skips the module without redis-server or the cluster extra

pytestmark = pytest.mark.slow

USER = "hana@example.com"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(tiny_models.tiny_model_dir("qwen2", "float32"))
    with LocalCluster(model, replicas=2, fronts=1, directory=tmp_path_factory.mktemp("ch")) as running:  # short: vLLM puts IPC sockets there
        running.model_name = Path(model).name
        yield running


def _health(front: str) -> httpx.Response:
    return httpx.get(f"{front}/health", timeout=10)


def _wait_health(front: str, healthy: int, timeout_s: float = 60) -> httpx.Response:
    """The front's /health once the router has seen ``healthy`` replicas up (its checks run every second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = _health(front)
        if answer.json().get("replicas_healthy") == healthy or time.monotonic() > deadline:
            return answer
        time.sleep(0.5)


def _chat(cluster, front: str) -> httpx.Response:
    body = {"model": cluster.model_name, "user": USER, "temperature": 0, "max_tokens": 2,
            "messages": [{"role": "user", "content": "Where was I born?"}]}
    return httpx.post(f"{front}/v1/chat/completions", json=body, timeout=120)


def test_a_replica_answers_only_the_engine_key_which_the_front_sends_through_the_router(cluster):
    (front,) = cluster.front_urls
    added = httpx.post(f"{front}/v1/memories", json={"user_id": USER, "facts": ["Hana was born in Kyoto."]}, timeout=120)
    assert added.status_code == 201, added.text
    answer = _chat(cluster, front)
    assert answer.status_code == 200 and answer.json()["inferscale"]["report"]["fallback"] is None, answer.text
    from inferscale.api import Context, GenerationAPI
    from inferscale.config import Config

    generation = GenerationAPI(Context(Config.from_toml(cluster.config_path)))
    request = generation.prompt(USER, "Where was I born?", [f.fact_id for f in generation.context.record.facts(USER).values()])
    leaked = {"model": cluster.model_name, "prompt": request.prompt["prompt_token_ids"], "max_tokens": 1,
              "cache_salt": request.prompt["cache_salt"], "kv_transfer_params": request.kv_transfer_params}
    for replica in cluster.replica_urls:
        assert httpx.post(f"{replica}/v1/completions", json=leaked, timeout=60).status_code == 401
        assert httpx.get(f"{replica}/health", timeout=10).status_code == 200  # the router's probe
        assert httpx.get(f"{replica}/metrics", timeout=10).status_code == 200


def test_a_front_is_healthy_while_one_replica_is_up_and_says_which(cluster):
    (front,) = cluster.front_urls
    both = _wait_health(front, 2)
    assert both.status_code == 200 and both.json() == {
        "status": "ok", "replicas_healthy": 2, "replicas": [{"replica": 0, "healthy": True},
                                                            {"replica": 1, "healthy": True}]}, both.text
    cluster.replica(cluster.replica_urls[0]).kill(signal.SIGKILL)
    one = _wait_health(front, 1)
    down = [r["replica"] for r in one.json()["replicas"] if not r["healthy"]]
    assert one.status_code == 200 and len(one.json()["replicas"]) == 2 and len(down) == 1, one.text
    assert [r["replica"] for r in _wait_health(front, 1).json()["replicas"] if not r["healthy"]] == down  # the same one
    assert httpx.get(f"{cluster.started['router'].url}/health", timeout=10).status_code == 503  # what it forwarded
    assert _chat(cluster, front).status_code == 200  # and chats still succeed
    cluster.replica(cluster.replica_urls[1]).kill(signal.SIGKILL)
    none = _wait_health(front, 0)
    assert none.status_code == 503 and none.json()["status"] == "unavailable", none.text
