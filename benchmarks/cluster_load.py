"""Requests/s with 1 and 2 replicas behind vllm-router, and the share of requests that found
their user hot under session affinity (deploy/local_cluster.py: Redis, the replicas, the
router, one front).

Per replica count: the cluster starts, ``--users`` users get ``--facts`` facts each, every user
chats once (the warm-up: each user's first request faults them in from Redis on the replica
their session key hashes to), then ``--clients`` closed-loop clients chat for ``--seconds``.
A request found its user hot when its replica answered from its own memory tier or prefix
cache; the replicas count what they fault in from the store of record
(``vllm:inferscale_store_hits_total{tier="redis"}``), so hot share = 1 − faults / chats.

    python benchmarks/cluster_load.py --model tiny --out benchmarks/results/cluster_load_cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "deploy"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_cluster import LocalCluster  # noqa: E402
from served import resolve_model  # noqa: E402

QUESTIONS = ["Where was I born?", "What is my pet called?", "What do I do for work?", "What do I like to eat?"]


def facts_of(i: int, n: int) -> list[str]:
    topics = [f"User {i} was born in city number {i}.", f"User {i} has a pet called Pet{i}.",
              f"User {i} works as engineer grade {i}.", f"User {i} likes to eat dish {i}."]
    return topics[:n]


def counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {"served": 0.0, "faults": 0.0, "hot_tier": 0.0}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "vllm:request_success_total":
                out["served"] += s.value
            elif s.name == "vllm:inferscale_store_hits_total":
                out["faults" if s.labels.get("tier") == "redis" else "hot_tier"] += s.value
    return out


def chat(client: httpx.Client, front: str, model: str, user: int, question: str) -> dict:
    body = {"model": model, "user": f"user{user}", "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "user", "content": question}]}
    response = client.post(front + "/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["inferscale"]


def load(front: str, model: str, users: int, clients: int, seconds: float) -> dict:
    done, failed, lock = [], [], threading.Lock()
    stop_at = time.monotonic() + seconds

    def client_loop(c: int):
        with httpx.Client() as client:
            i = c
            while time.monotonic() < stop_at:
                try:
                    info = chat(client, front, model, i % users, QUESTIONS[(i // users) % len(QUESTIONS)])
                    with lock:
                        done.append(info)
                except Exception as exc:  # noqa: BLE001
                    with lock:
                        failed.append(str(exc)[:200])
                i += clients

    start = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    fallbacks = [((d.get("report") or {}).get("fallback")) for d in done]
    return {"chats": len(done), "failed": len(failed), "failures": failed[:5], "seconds": round(elapsed, 2),
            "requests_per_s": round(len(done) / elapsed, 3),
            "with_memory": sum(1 for d, f in zip(done, fallbacks) if d["mode"] == "kv" and f is None)}


def run(model: str, replicas: int, args) -> dict:
    with LocalCluster(model, replicas=replicas, fronts=1) as cluster:
        front, name = cluster.front_urls[0], Path(model).name
        with httpx.Client() as client:
            for i in range(args.users):
                client.post(front + "/v1/memories", json={"user_id": f"user{i}", "facts": facts_of(i, args.facts)},
                            timeout=300).raise_for_status()
            for i in range(args.users):  # warm-up: each user's first request faults them in
                chat(client, front, name, i, QUESTIONS[0])
        before = {u: counters(u) for u in cluster.replica_urls}
        result = load(front, name, args.users, args.clients, args.seconds)
        after = {u: counters(u) for u in cluster.replica_urls}
    faults = sum(after[u]["faults"] - before[u]["faults"] for u in after)
    per_replica = {u: after[u]["served"] - before[u]["served"] for u in after}
    result.update(replicas=replicas, faults=faults, served_per_replica=list(per_replica.values()),
                  hot_share=round(1 - faults / result["chats"], 4) if result["chats"] else None)
    return result


def table(results: list[dict]) -> str:
    lines = ["| replicas | requests/s | chats | failed | answered from memory | faulted in from Redis | "
             "hot share | per replica |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['replicas']} | {r['requests_per_s']:.2f} | {r['chats']} | {r['failed']} | "
                     f"{r['with_memory']} | {r['faults']:.0f} | {100 * r['hot_share']:.1f} % | "
                     f"{', '.join(f'{n:.0f}' for n in r['served_per_replica'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--facts", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/cluster_load_cpu"))
    args = parser.parse_args()
    model = resolve_model(args.model)
    results = [run(model, n, args) for n in args.replicas]
    out = Path(args.out)
    meta = {"model": args.model, "users": args.users, "facts_per_user": args.facts, "clients": args.clients,
            "seconds": args.seconds, "machine": f"{platform.machine()}, {__import__('os').cpu_count()} cores",
            "policy": "vllm-router consistent_hash on X-Session-ID", "store": "redis", "memory_tier": "pinned"}
    out.with_suffix(".json").write_text(json.dumps({"setup": meta, "results": results}, indent=2) + "\n")
    out.with_suffix(".md").write_text(f"# Replicas behind vllm-router ({args.model}, CPU)\n\n"
                                      f"{json.dumps(meta)}\n\n{table(results)}")
    print(table(results))
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
