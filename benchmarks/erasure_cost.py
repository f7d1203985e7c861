"""What erasure costs: the engine port's lock on every request, and emptying vLLM's prefix cache.

Two ways keep a deleted memory from being served from vLLM's prefix cache under a leaked salt
(docs/server.md, "What a deletion guarantees"): the lock (``inferscale/server/engine_guard.py``:
the engine answers only the front's key; every request pays a header compare), and emptying the
prefix cache after each delete (``--forget-resets-prefix-cache``; every user's cached memory is
then prefilled again). This measures both:

1. the lock, in process: µs a request takes through the ASGI guard and without it (an app that
   answers at once, called directly, ``--requests`` of each, interleaved in rounds);
2. the reset, through ``inferscale serve MODEL --forget-resets-prefix-cache``: the server's own
   requests for user A (12 facts; memory injected, and the same facts as text) sent to the engine
   with the key, with A's memory in vLLM's prefix cache (sent before), then right after another
   user is forgotten (the reset), for ``--rounds`` rounds: the engine's time and the prompt
   tokens it counted cached (vLLM counts the tokens the connector injects as cached too); and the
   forget's own time.

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
    """µs one request takes through an ASGI app that answers at once, with and without the guard
    in front of it (called directly: no HTTP, no test client, so the guard's own cost shows)."""
    import asyncio

    from inferscale.server.engine_guard import EngineGuard

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json"), (b"authorization", b"Bearer " + b"k" * 64)]}
    apps = {"plain": app, "locked": EngineGuard(app, key="k" * 64)}

    async def timed(target) -> float:
        start = time.perf_counter()
        for _ in range(requests):
            await target(dict(scope), receive, send)
        return (time.perf_counter() - start) / requests * 1e6

    per = {name: [] for name in apps}
    for _ in range(rounds):
        for name, target in apps.items():
            per[name].append(asyncio.run(timed(target)))
    plain, locked = statistics.median(per["plain"]), statistics.median(per["locked"])
    return {"requests_per_round": requests, "rounds": rounds, "plain_us": plain, "locked_us": locked,
            "lock_us": locked - plain}


def reset_cost(model: str, rounds: int, work: Path) -> dict:
    server = Server(resolve_model(model), work / "data", free_port(), work / "serve.log",
                    ("--forget-resets-prefix-cache", "--enable-prompt-tokens-details", "--max-model-len", "2048"))
    server.start()
    try:
        httpx.post(f"{server.url}/v1/memories", json={"user_id": "ana", "facts": FACTS}, timeout=600).raise_for_status()
        sends = {mode: _engine_request(server, mode) for mode in ("kv", "prompt")}
        rows = []
        for _ in range(rounds):
            row = {}
            for mode, send in sends.items():
                send()
                row[f"{mode}_warm"] = send()
            httpx.post(f"{server.url}/v1/memories", json={"user_id": "bob", "facts": ["Bob rows."]},
                       timeout=600).raise_for_status()
            start = time.perf_counter()
            forgot = httpx.delete(f"{server.url}/v1/memories", params={"user_id": "bob"}, timeout=600).json()
            row["forget_ms"], row["reset"] = (time.perf_counter() - start) * 1e3, forgot["prefix_cache_reset"]
            for mode, send in sends.items():
                row[f"{mode}_after_reset"] = send()
            rows.append(row)
        keys = [k for k in rows[0] if k.startswith(("kv_", "prompt_"))]
        return {"model": model, "rounds": rows, "forget_ms": statistics.median(r["forget_ms"] for r in rows),
                **{k: {"ms": statistics.median(r[k][0] for r in rows), "cached": statistics.median(r[k][1] for r in rows)}
                   for k in keys}}
    finally:
        server.stop()


def _engine_request(server: Server, mode: str):
    """The server's request for A's question (``kv``: memory injected; ``prompt``: the same facts as
    text), sent to the engine with the key; each call its (ms, cached prompt tokens)."""
    from inferscale.api import Context, GenerationAPI
    from inferscale.config import Config

    context = Context(Config.from_dict({"model": server.model, "data_dir": str(server.data_dir)}))
    generation = GenerationAPI(context)
    ids = [f.fact_id for f in context.record.facts("ana").values()]
    request = generation.prompt("ana", "What is my locker code?", ids, mode=mode)
    engine = f"http://127.0.0.1:{server.engine_port()}"
    model = httpx.get(f"{engine}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": request.prompt["prompt_token_ids"], "max_tokens": 1, "temperature": 0,
            "cache_salt": request.prompt["cache_salt"],
            **({"kv_transfer_params": request.kv_transfer_params} if request.kv_transfer_params else {})}
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
    parser.add_argument("--requests", type=int, default=20000, help="requests per round through the lock")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/erasure_cost_cpu.json"))
    args = parser.parse_args()
    lock = lock_cost(args.requests)
    reset = reset_cost(args.model, args.rounds, Path(tempfile.mkdtemp(prefix="erasure-cost-")))
    print("| what | median |\n|---|---|")
    print(f"| a request to an app that answers at once, without the lock / through it | {lock['plain_us']:.1f} µs / "
          f"{lock['locked_us']:.1f} µs (the lock: {lock['lock_us']:+.1f} µs) |")
    for mode, label in (("kv", "memory injected"), ("prompt", "the same facts as text")):
        warm, after = reset[f"{mode}_warm"], reset[f"{mode}_after_reset"]
        print(f"| A's request, {label}: in vLLM's prefix cache / after another user's forget emptied it | "
              f"{warm['ms']:.1f} ms ({warm['cached']:.0f} tokens cached) / {after['ms']:.1f} ms "
              f"({after['cached']:.0f}) |")
    print(f"| the forget, with the reset | {reset['forget_ms']:.0f} ms |")
    Path(args.out).write_text(json.dumps({"lock": lock, "reset": reset}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
