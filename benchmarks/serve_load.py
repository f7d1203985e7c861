"""Load run: `inferscale serve` on loopback, many users chatting with their memory while it changes.

    python benchmarks/serve_load.py                               # 100 users, 10 minutes, the 0.5B model
    python benchmarks/serve_load.py --users 10 --seconds 30 --out /tmp/load   # the short run CI makes

1. starts `inferscale serve MODEL` (benchmarks/served.py) on a fresh data directory;
2. gives every user their own facts through POST /v1/memories (a name, a city, a pet, a code, ...);
3. every user chats once (so the memory tier holds everyone), then for ``--seconds``:
   one closed-loop task per user asks the `openai` async client (``user=``) about one of their
   facts, again and again; ``--writers`` other tasks add facts, update and delete facts, and
   forget a user and store them again, on random users;
4. samples the resident memory (RSS) of the front and the engine's processes every ``--sample-s``.

A request *fails* if it gets no 2xx answer, except a chat for a user who was being forgotten and
stored again while it ran: that one may rightly get a 404 ("no memory stored"), counted apart.
A chat whose answer lists a fact id of another user counts as a leak. Results: ``<out>.json``,
``<out>.md`` and ``<out>.png`` (memory and latency over time).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import REPO, Server, free_port, resolve_model  # noqa: E402

sys.path.insert(0, str(REPO))
from inferscale.facts import fact_id_key, make_fact_id  # noqa: E402
from inferscale.secret import load_secret  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "serve_load_cpu"
FIRST = ["Ada", "Bruno", "Chiara", "Dmitri", "Elif", "Farah", "Goran", "Hana", "Ines", "Jonas", "Kaito", "Lena",
         "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Tariq"]
#: (fact, question, the answer's word): every user gets each with their own value
TEMPLATES = [
    ("{name}'s cat is called {pet}.", "What is my cat called?", "pet"),
    ("{name} lives in {city}.", "Which city do I live in?", "city"),
    ("{name} plays the {instrument}.", "Which instrument do I play?", "instrument"),
    ("{name}'s locker code is {code}.", "What is my locker code?", "code"),
    ("{name} works as a {job}.", "What is my job?", "job"),
    ("{name} is allergic to {food}.", "What am I allergic to?", "food"),
    ("{name}'s favourite colour is {colour}.", "What is my favourite colour?", "colour"),
    ("{name} drives a {car}.", "What car do I drive?", "car"),
]
VALUES = {
    "pet": ["Pixel", "Biscuit", "Mango", "Zorba", "Pepper", "Nimbus", "Tofu", "Socks", "Olive", "Juno"],
    "city": ["Porto", "Tromso", "Lyon", "Kyoto", "Quito", "Gdansk", "Bergen", "Leeds", "Turin", "Malmo"],
    "instrument": ["cello", "oboe", "banjo", "harp", "tuba", "violin", "flute", "drums", "sitar", "ukulele"],
    "job": ["nurse", "baker", "pilot", "welder", "dentist", "florist", "plumber", "librarian", "chemist", "tailor"],
    "food": ["peanuts", "shellfish", "kiwi", "sesame", "eggs", "soy", "mustard", "celery", "lupin", "oats"],
    "colour": ["teal", "amber", "violet", "crimson", "ochre", "indigo", "coral", "olive", "silver", "magenta"],
    "car": ["Volvo", "Fiat", "Skoda", "Saab", "Mazda", "Lancia", "Dacia", "Seat", "Opel", "Tesla"],
}
EXTRA = ["{name} visited {city} on day {n}.", "{name} read a book about {pet} the explorer, part {n}.",
         "{name} bought {n} jars of honey at the {colour} market."]


@dataclass
class User:
    uid: str
    name: str
    base: list[tuple[str, str, str]]  # (fact, question, expected word)
    facts: dict[str, str] = field(default_factory=dict)  # fact id → text, as last answered by the server
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one writer at a time per user
    forgets: int = 0  # forgets started
    absent: bool = False  # forgotten, not yet stored again

    def base_facts(self) -> list[str]:
        return [fact for fact, _, _ in self.base]


@dataclass
class Run:
    args: argparse.Namespace
    users: list[User]
    owner: dict[str, str] = field(default_factory=dict)  # fact id → user, registered before the write is sent
    events: list[dict] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    t0: float = 0.0
    #: the server's key of fact ids (from its secret, made as it started), to know each fact's owner
    id_key: bytes | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def own(self, user: User, texts: list[str]) -> None:
        for text in texts:
            self.owner[make_fact_id(user.uid, text, None, self.id_key)] = user.uid


def make_users(n: int, facts: int, seed: int) -> list[User]:
    rng = random.Random(seed)
    users, codes = [], rng.sample(range(1000, 10000), n)
    for i in range(n):
        name = f"{FIRST[i % len(FIRST)]} {chr(65 + i // len(FIRST) % 26)}{i}"
        values = {key: rng.choice(options) for key, options in VALUES.items()} | {"code": str(codes[i])}
        base = [(fact.format(name=name, **values), question, values[key])
                for fact, question, key in TEMPLATES[:facts]]
        users.append(User(f"load-{i:03d}@example.com", name, base))
    return users


# ---------------------------------------------------------------- requests


async def timed(run: Run, kind: str, user: User, call, expect_404: bool = False) -> tuple[dict, object]:
    """Run ``call()`` (→ (status, answer)); record it as ok, an expected 404 or a failure;
    (the recorded event, the answer)."""
    start, forgets = run.now(), user.forgets
    was_absent = user.absent
    try:
        status, body = await call()
    except Exception as exc:  # noqa: BLE001 - a transport error is a failed request
        status, body = None, {"error": f"{type(exc).__name__}: {exc}"}
    event = {"kind": kind, "user": user.uid, "t0": start, "t1": run.now(), "status": status}
    if status is not None and 200 <= status < 300:
        event["outcome"] = "ok"
    elif status == 404 and expect_404 and (was_absent or user.absent or user.forgets != forgets):
        event["outcome"] = "expected_404"
    else:
        event["outcome"], event["error"] = "failed", str(body)[:300]
    run.events.append(event)
    return event, body


async def chat(run: Run, client, user: User, question: str, expected: str) -> dict:
    from openai import APIStatusError

    async def call():
        try:
            answer = await client.chat.completions.create(
                model=run.args.model, user=user.uid, max_tokens=run.args.max_tokens, temperature=0.0,
                messages=[{"role": "user", "content": question}])
        except APIStatusError as exc:
            return exc.status_code, exc.body
        return 200, answer

    event, body = await timed(run, "chat", user, call, expect_404=True)
    if event["outcome"] == "ok":
        memory = body.model_extra.get("inferscale") or {}
        report = memory.get("report") or {}
        text = body.choices[0].message.content or ""
        foreign = [f for f in memory.get("fact_ids", []) if run.owner.get(f) != user.uid]  # another's, or unknown
        event.update(fallback=report.get("fallback"), injected=report.get("injected_tokens", 0),
                     facts=len(memory.get("fact_ids", [])), right=expected.lower() in text.lower(), foreign=foreign)
    return event


async def http_status(coro) -> tuple[int, object]:
    response = await coro
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


async def add(run: Run, http: httpx.AsyncClient, user: User, texts: list[str], kind: str = "add") -> dict:
    run.own(user, texts)
    event, body = await timed(run, kind, user, lambda: http_status(
        http.post("/v1/memories", json={"user_id": user.uid, "facts": texts})))
    if event["outcome"] == "ok":
        user.facts.update({f["id"]: f["text"] for f in body["results"]})
    return event


async def update(run: Run, http: httpx.AsyncClient, user: User, rng: random.Random) -> dict:
    fact_id = rng.choice(list(user.facts))
    text = user.facts[fact_id].rstrip(".") + f", as of update {rng.randrange(10**6)}."
    run.own(user, [text])
    event, body = await timed(run, "update", user, lambda: http_status(
        http.put(f"/v1/memories/{fact_id}", json={"user_id": user.uid, "text": text})))
    if event["outcome"] == "ok":
        del user.facts[fact_id]
        new = body["result"]
        user.facts[new["id"]] = new["text"]
    return event


async def delete(run: Run, http: httpx.AsyncClient, user: User, rng: random.Random) -> dict:
    fact_id = rng.choice(list(user.facts))
    event, _ = await timed(run, "delete", user, lambda: http_status(
        http.delete(f"/v1/memories/{fact_id}", params={"user_id": user.uid})))
    if event["outcome"] == "ok":
        del user.facts[fact_id]
    return event


async def forget_and_store(run: Run, http: httpx.AsyncClient, user: User) -> None:
    """Forget the user, then store their base facts again (chats meanwhile may get a 404)."""
    user.forgets += 1
    user.absent = True
    try:
        event, _ = await timed(run, "forget", user, lambda: http_status(
            http.delete("/v1/memories", params={"user_id": user.uid})))
        if event["outcome"] == "ok":
            user.facts.clear()
        await add(run, http, user, user.base_facts(), kind="restore")
    finally:
        user.absent = not user.facts


# ---------------------------------------------------------------- tasks


async def chatter(run: Run, client, user: User, deadline: float, rng: random.Random) -> None:
    while run.now() < deadline:
        _, question, expected = rng.choice(user.base)
        event = await chat(run, client, user, question, expected)
        if event["outcome"] == "expected_404":
            await asyncio.sleep(1.0)  # the user is being stored again: ask again a little later
        elif run.args.think_s:
            await asyncio.sleep(rng.expovariate(1 / run.args.think_s))


async def writer(run: Run, http: httpx.AsyncClient, deadline: float, rng: random.Random, first: int) -> None:
    """Writes on random users, the kinds in turn (so a short run has each): forget and store
    again, add, update, add, delete."""
    ops = itertools.islice(itertools.cycle(["forget", "add", "update", "add", "delete"]), first, None)
    while run.now() < deadline:
        user = rng.choice(run.users)
        async with user.lock:
            op = next(ops)
            if op == "forget":
                await forget_and_store(run, http, user)
            elif op == "add" or len(user.facts) <= len(user.base) // 2:
                extra = rng.choice(EXTRA).format(name=user.name, n=rng.randrange(10**6),
                                                 **{k: rng.choice(v) for k, v in VALUES.items()})
                await add(run, http, user, [extra])
            elif op == "update":
                await update(run, http, user, rng)
            else:
                await delete(run, http, user, rng)
        await asyncio.sleep(rng.uniform(0, run.args.write_pause_s))


async def sampler(run: Run, server: Server, stop: asyncio.Event) -> None:
    while not stop.is_set():
        rss = await asyncio.to_thread(server.rss)
        run.memory.append({"t": run.now(), **rss, "loadavg": os.getloadavg()[0]})
        try:
            await asyncio.wait_for(stop.wait(), run.args.sample_s)
        except TimeoutError:
            pass


# ---------------------------------------------------------------- phases


async def setup(run: Run, http: httpx.AsyncClient) -> float:
    start = time.monotonic()
    for user in run.users:
        event = await add(run, http, user, user.base_facts(), kind="setup")
        if event["outcome"] != "ok":
            raise RuntimeError(f"could not store {user.uid}'s facts: {event.get('error')}")
    return time.monotonic() - start


async def load(run: Run, server: Server) -> dict:
    from openai import AsyncOpenAI

    args = run.args
    limits = httpx.Limits(max_connections=len(run.users) + args.writers + 8)
    async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as http:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="EMPTY", max_retries=0, timeout=600.0,
                             http_client=httpx.AsyncClient(timeout=600, limits=limits))
        stop = asyncio.Event()
        run.t0 = time.monotonic()
        sampling = asyncio.create_task(sampler(run, server, stop))
        phases = {"setup_s": await setup(run, http)}
        phases["warmup_start"] = run.now()
        await asyncio.gather(*(chat(run, client, u, *rng_pick(u, args.seed)) for u in run.users))
        start = run.now()
        phases["load_start"], deadline = start, start + args.seconds
        rng = random.Random(args.seed)
        tasks = [chatter(run, client, u, deadline, random.Random(rng.random())) for u in run.users]
        tasks += [writer(run, http, deadline, random.Random(rng.random()), 2 * i) for i in range(args.writers)]
        await asyncio.gather(*tasks)
        phases["load_end"] = run.now()
        phases["metrics"] = (await http.get("/metrics")).text
        stop.set()
        await sampling
        await client.close()
    return phases


def rng_pick(user: User, seed: int) -> tuple[str, str]:
    _, question, expected = random.Random(f"{seed}:{user.uid}").choice(user.base)
    return question, expected


# ---------------------------------------------------------------- results


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def slope_mb_per_min(samples: list[dict], start: float, end: float) -> float | None:
    points = [(s["t"], s["total"] / 2**20) for s in samples if start <= s["t"] <= end]
    if len(points) < 3:
        return None
    return statistics.linear_regression(*zip(*points)).slope * 60


def log_errors(text: str) -> int:
    return sum(("Traceback" in line or " ERROR " in line) for line in text.splitlines())


def summarize(run: Run, phases: dict, ready_s: float, log_text: str) -> dict:
    start, end = phases["load_start"], phases["load_end"]
    during = [e for e in run.events if e["t0"] >= start]
    chats = [e for e in during if e["kind"] == "chat"]
    ok_chats = [e for e in chats if e["outcome"] == "ok"]
    writes = [e for e in during if e["kind"] != "chat"]
    latency = [(e["t1"] - e["t0"]) * 1e3 for e in ok_chats]
    write_latency = [(e["t1"] - e["t0"]) * 1e3 for e in writes if e["outcome"] == "ok"]
    steady = [s for s in run.memory if start <= s["t"] <= end]
    fallbacks: dict[str, int] = {}
    for e in ok_chats:
        fallbacks[str(e.get("fallback"))] = fallbacks.get(str(e.get("fallback")), 0) + 1
    all_failed = [e for e in run.events if e["outcome"] == "failed"]
    return {
        "requests": len(during),
        "chats": len(chats),
        "writes": {kind: sum(e["kind"] == kind for e in writes) for kind in
                   ("add", "update", "delete", "forget", "restore")},
        "failed": len([e for e in during if e["outcome"] == "failed"]),
        "failed_outside_load": len(all_failed) - len([e for e in during if e["outcome"] == "failed"]),
        "failures": [{k: e.get(k) for k in ("kind", "user", "t0", "status", "error")} for e in all_failed[:20]],
        "expected_404": len([e for e in during if e["outcome"] == "expected_404"]),
        "leaks": sum(len(e.get("foreign", [])) for e in ok_chats),
        "chat_fallbacks": fallbacks,
        "chat_right": sum(e.get("right", False) for e in ok_chats),
        "chat_p50_ms": percentile(latency, 50), "chat_p99_ms": percentile(latency, 99),
        "write_p50_ms": percentile(write_latency, 50), "write_p99_ms": percentile(write_latency, 99),
        "requests_per_s": len([e for e in during if e["outcome"] != "failed"]) / (end - start),
        "chats_per_s": len(ok_chats) / (end - start),
        "rss_mb_start": steady[0]["total"] / 2**20 if steady else None,
        "rss_mb_end": steady[-1]["total"] / 2**20 if steady else None,
        "rss_mb_max": max(s["total"] for s in steady) / 2**20 if steady else None,
        "rss_slope_mb_per_min": slope_mb_per_min(run.memory, start, end),
        "rss_slope_second_half_mb_per_min": slope_mb_per_min(run.memory, (start + end) / 2, end),
        "server_ready_s": ready_s, "setup_s": phases["setup_s"], "load_s": end - start,
        "host_loadavg_1min": [min(s["loadavg"] for s in steady), max(s["loadavg"] for s in steady)] if steady else None,
        "server_log_errors": log_errors(log_text),
        "fallbacks_metric": [line for line in phases["metrics"].splitlines()
                             if line.startswith("vllm:inferscale_fallbacks_total") and not line.endswith(" 0.0")],
    }


def markdown(summary: dict, args: argparse.Namespace, command: str) -> str:
    def ms(v):
        return "–" if v is None else f"{v:,.0f} ms"

    def mb(v, unit=" MB", sign=""):
        return "–" if v is None else f"{v:{sign},.2f}{unit}" if sign else f"{v:,.0f}{unit}"

    rows = [
        ("users / facts each", f"{args.users} / {args.facts}"),
        ("load", f"{summary['load_s']:.0f} s, {args.writers} writer task(s), max_tokens {args.max_tokens}"),
        ("requests (chats + writes)", f"{summary['requests']:,} ({summary['chats']:,} + "
                                      f"{summary['requests'] - summary['chats']:,}: {summary['writes']})"),
        ("failed requests", str(summary["failed"])),
        ("404 for a user being forgotten (expected)", str(summary["expected_404"])),
        ("another user's fact in an answer", str(summary["leaks"])),
        ("chat fallbacks (reason: chats)", json.dumps(summary["chat_fallbacks"])),
        ("chat latency p50 / p99", f"{ms(summary['chat_p50_ms'])} / {ms(summary['chat_p99_ms'])}"),
        ("write latency p50 / p99", f"{ms(summary['write_p50_ms'])} / {ms(summary['write_p99_ms'])}"),
        ("requests/s (chats/s)", f"{summary['requests_per_s']:.2f} ({summary['chats_per_s']:.2f})"),
        ("RSS front + engine: start → end (max)", f"{mb(summary['rss_mb_start'], '')} → "
                                                   f"{mb(summary['rss_mb_end'])} ({mb(summary['rss_mb_max'], '')})"),
        ("RSS slope: whole load / second half", f"{mb(summary['rss_slope_mb_per_min'], '', '+')} / "
                                                f"{mb(summary['rss_slope_second_half_mb_per_min'], ' MB/min', '+')}"),
        ("host load average (1 min) during the load, 2 cores", "{:.1f}–{:.1f}".format(*summary["host_loadavg_1min"])),
        ("answers with the asked fact's word", f"{summary['chat_right']:,} of {summary['chats'] - summary['expected_404']:,}"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return f"# Load run: `inferscale serve` {Path(args.model).name}\n\n`{command}`\n\n| | |\n|---|---|\n{table}\n"


def plot(run: Run, phases: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    start = phases["load_start"]
    times = [(s["t"] - start) / 60 for s in run.memory]
    top.plot(times, [s["total"] / 2**20 for s in run.memory], label="front + engine", color="black")
    for name in sorted({k for s in run.memory for k in s if k not in ("t", "total", "loadavg")}):
        top.plot(times, [s.get(name, 0) / 2**20 for s in run.memory], label=name.split(":")[0], lw=0.8)
    top.set_ylabel("RSS (MB)")
    top.legend(fontsize=7, loc="center right")
    chats = [e for e in run.events if e["kind"] == "chat" and e["outcome"] == "ok"]
    bottom.scatter([(e["t1"] - start) / 60 for e in chats], [(e["t1"] - e["t0"]) for e in chats], s=2, alpha=0.3,
                   label="chat")
    writes = [e for e in run.events if e["kind"] != "chat" and e["outcome"] == "ok"]
    bottom.scatter([(e["t1"] - start) / 60 for e in writes], [(e["t1"] - e["t0"]) for e in writes], s=4,
                   color="tab:red", alpha=0.5, label="memory write")
    bottom.set_ylabel("latency (s)")
    bottom.set_xlabel("minutes since the load started (before 0: storing facts, one chat per user)")
    bottom.legend(fontsize=7)
    for ax in (top, bottom):
        ax.axvline(0, color="grey", lw=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct",
                        help="what `inferscale serve` serves; 'tiny': the tests' random-weight Qwen2")
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--facts", type=int, default=len(TEMPLATES), help=f"base facts per user (≤ {len(TEMPLATES)})")
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--writers", type=int, default=2, help="tasks writing memory beside the chats")
    parser.add_argument("--write-pause-s", type=float, default=4.0, help="pause between a writer's writes: 0..this")
    parser.add_argument("--think-s", type=float, default=0.0, help="mean pause between a user's chats")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="results: OUT.json, OUT.md, OUT.png")
    parser.add_argument("--data-dir", help="default: a fresh temporary directory")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("serve_args", nargs="*", help="more `inferscale serve` arguments (after --)")
    args = parser.parse_args(argv)
    args.model = resolve_model(args.model)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="serve-load-", dir=os.environ.get("TMPDIR")))
    data = Path(args.data_dir) if args.data_dir else work / "data"
    server = Server(args.model, data, args.port or free_port(), work / "server.log", tuple(args.serve_args))
    run = Run(args, make_users(args.users, args.facts, args.seed))
    command = " ".join(["python benchmarks/serve_load.py", *(argv if argv is not None else sys.argv[1:])])
    served = 0
    try:
        ready_s = server.start()
        run.id_key = fact_id_key(load_secret(data / "secret"))
        phases = asyncio.run(load(run, server))
    finally:
        served = server.log.stat().st_size if server.log.exists() else 0  # what was logged while serving
        exit_code = server.stop()
    log = server.log.read_bytes()
    summary = summarize(run, phases, ready_s, log[:served].decode(errors="replace"))
    summary["front_exit_code"] = exit_code
    # vLLM's engine may log EngineDeadError while the front stops it: counted apart
    summary["shutdown_log_errors"] = log_errors(log[served:].decode(errors="replace"))
    result = {"command": command, "model": args.model, "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(),
              "args": {k: v for k, v in vars(args).items() if k != "serve_args"}, "summary": summary,
              "phases": {k: v for k, v in phases.items() if k != "metrics"}, "memory": run.memory,
              "events": run.events, "server_log": str(server.log)}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(summary, args, command))
    try:
        plot(run, phases, out.with_suffix(".png"))
    except ImportError as exc:  # the numbers matter more than the picture
        print(f"no plot ({exc}); draw it later from the JSON")
    print(out.with_suffix(".md").read_text())
    return 0 if summary["failed"] == 0 and summary["leaks"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
