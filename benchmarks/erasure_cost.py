"""What erasure costs: the engine port's lock on every request, and emptying vLLM's prefix cache.

Two ways keep a deleted memory from being served from vLLM's prefix cache under a leaked salt
(docs/server.md, "What a deletion guarantees"): the lock (``inferscale/server/engine_guard.py``:
the engine answers only the front's key; every request pays a header compare), and emptying the
prefix cache after each delete (``--forget-resets-prefix-cache``; every user's cached memory is
then prefilled again). This measures both:

1. the lock, in process: µs an HTTP request takes through the ASGI guard and without it (a
   trivial app, Starlette's test client, ``--requests`` of each, interleaved in rounds);
2. the reset, through ``inferscale serve MODEL --forget-resets-prefix-cache``: the server's own
   request for user A (12 facts) sent to the engine with the key, with A's memory in vLLM's prefix
   cache (sent before), then right after another user is forgotten (the reset), for ``--rounds``
   rounds: the engine's time and the prompt tokens it found cached; and the forget's own time.

    python benchmarks/erasure_cost.py [--model tiny] [--rounds 5] [--requests 2000]

Prints a table and writes ``benchmarks/results/erasure_cost_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import REPO, Server, free_port, resolve_model  # noqa: E402

FACTS = [f"Ana's note {i}: the locker code is {1000 + i}." for i in range(12)]


def lock_cost(requests: int, rounds: int = 5) -> dict:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from inferscale.server.engine_guard import EngineGuard

    def client(locked: bool) -> TestClient:
        app = Starlette(routes=[Route("/v1/completions", lambda r: PlainTextResponse("ok"), methods=["POST"])])
        if locked:
            app.add_middleware(EngineGuard, key="k" * 64)
        return TestClient(app)

    clients, headers = {False: client(False), True: client(True)}, {"Authorization": "Bearer " + "k" * 64}
    per = {False: [], True: []}
    for _ in range(rounds):
        for locked, c in clients.items():
            start = time.perf_counter()
            for _ in range(requests):
                c.post("/v1/completions", headers=headers)
            per[locked].append((time.perf_counter() - start) / requests * 1e6)
    plain, locked = statistics.median(per[False]), statistics.median(per[True])
    return {"requests_per_round": requests, "rounds": rounds, "plain_us": plain, "locked_us": locked,
            "lock_us": locked - plain}


def reset_cost(model: str, rounds: int, work: Path) -> dict:
    server = Server(resolve_model(model), work / "data", free_port(), work / "serve.log",
                    ("--forget-resets-prefix-cache", "--enable-prompt-tokens-details", "--max-model-len", "2048"))
    server.start()
    try:
        httpx.post(f"{server.url}/v1/memories", json={"user_id": "ana", "facts": FACTS}, timeout=600).raise_for_status()
        send = _engine_request(server)
        rows = []
        for _ in range(rounds):
            send()
            warm = send()
            httpx.post(f"{server.url}/v1/memories", json={"user_id": "bob", "facts": ["Bob rows."]},
                       timeout=600).raise_for_status()
            start = time.perf_counter()
            forgot = httpx.delete(f"{server.url}/v1/memories", params={"user_id": "bob"}, timeout=600).json()
            forget_ms = (time.perf_counter() - start) * 1e3
            after = send()
            rows.append({"warm_ms": warm[0], "warm_cached": warm[1], "after_reset_ms": after[0],
                         "after_reset_cached": after[1], "forget_ms": forget_ms, "reset": forgot["prefix_cache_reset"]})
        return {"model": model, "rounds": rows, **{k: statistics.median(r[k] for r in rows)
                                                    for k in ("warm_ms", "after_reset_ms", "forget_ms")}}
    finally:
        server.stop()


def _engine_request(server: Server):
    from inferscale.api import Context, GenerationAPI
    from inferscale.config import Config

    context = Context(Config.from_dict({"model": server.model, "data_dir": str(server.data_dir)}))
    generation = GenerationAPI(context)
    request = generation.prompt("ana", "What is my locker code?", [f.fact_id for f in context.disk.facts("ana").values()])
    engine = f"http://127.0.0.1:{server.engine_port()}"
    model = httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": request.prompt["prompt_token_ids"], "max_tokens": 1, "temperature": 0,
            "cache_salt": request.prompt["cache_salt"], "kv_transfer_params": request.kv_transfer_params}
    headers = {"Authorization": f"Bearer {context.engine_key}"}

    def send() -> tuple[float, int]:
        start = time.perf_counter()
        usage = httpx.post(f"{engine}/v1/completions", json=body, headers=headers, timeout=600).json()["usage"]
        return (time.perf_counter() - start) * 1e3, (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    return send


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="what `inferscale serve` serves ('tiny': the tests' Qwen2)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of warm request, forget, request")
    parser.add_argument("--requests", type=int, default=2000, help="requests per round through the lock")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/erasure_cost_cpu.json"))
    args = parser.parse_args()
    lock = lock_cost(args.requests)
    reset = reset_cost(args.model, args.rounds, Path(tempfile.mkdtemp(prefix="erasure-cost-")))
    print("| what | median |\n|---|---|")
    print(f"| an HTTP request without the lock / through it (in process) | {lock['plain_us']:.0f} µs / "
          f"{lock['locked_us']:.0f} µs (the lock: {lock['lock_us']:+.1f} µs) |")
    print(f"| the server's request, A's memory cached ({reset['rounds'][0]['warm_cached']} tokens) | "
          f"{reset['warm_ms']:.1f} ms |")
    print(f"| the same, after another user was forgotten and the cache emptied "
          f"({reset['rounds'][0]['after_reset_cached']} cached) | {reset['after_reset_ms']:.1f} ms |")
    print(f"| the forget with the reset | {reset['forget_ms']:.0f} ms |")
    Path(args.out).write_text(json.dumps({"lock": lock, "reset": reset}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
