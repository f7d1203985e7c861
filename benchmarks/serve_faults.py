"""Fault run: kill -9 `inferscale serve` (front and engine) while memory writes are in flight, restart it.

    python benchmarks/serve_faults.py                        # 5 rounds, the tiny Qwen2 model
    python benchmarks/serve_faults.py --rounds 1 --out /tmp/faults      # the round CI makes

Each round, on one data directory kept across rounds:
1. start `inferscale serve` (same port every round) and let ``--writers`` tasks write memory:
   add one to three facts, delete a fact, update a fact, forget a user; each writer owns its users,
   so the expected state of every user is known exactly: what got a 2xx answer is *committed*, the
   one write per user that got no answer is *in flight* (either outcome is allowed, never a part);
2. after a delay that differs per round, SIGKILL every process of the front and the engine at once;
3. note what the crash left on disk (temp files, segments no index lists, directories without an
   index), and plant one of each as well (a crash in the middle of a file write leaves exactly
   these), so the clean-up is checked every round even when the kill lands between writes;
4. restart on the same port and check: every user's facts are the committed ones (plus, for the
   write in flight, all of it or none of it); every user's K/V reads back verified (the store's
   checksums) and a chat over all their facts injects them with no fallback; a forgotten user stays
   forgotten; nothing left over on disk; the planted user is not listed.
Results: ``<out>.json`` and ``<out>.md``; exit status 1 if any check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import REPO, Server, free_port, resolve_model  # noqa: E402

sys.path.insert(0, str(REPO))
from inferscale.facts import fact_id_key, make_fact_id  # noqa: E402
from inferscale.secret import load_secret  # noqa: E402
from inferscale.storage.disk import DiskStore  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "serve_faults_cpu"
GHOST = "ghost@example.com"  # the user planted half-written: never committed, must never appear
WORDS = ["amber", "birch", "cobalt", "dune", "ember", "fjord", "granite", "harbor", "iris", "juniper", "kelp",
         "lagoon", "maple", "nectar", "opal", "pine", "quartz", "reef", "saffron", "tundra"]


@dataclass
class UserState:
    uid: str
    facts: dict[str, str] = field(default_factory=dict)  # committed: fact id → text
    #: the write that got no answer: (kind, facts it would add, fact ids it would remove)
    in_flight: tuple[str, dict[str, str], set[str]] | None = None
    forgotten: bool = False  # the last committed write forgot the user
    #: the server's key of fact ids (from its secret), to name the facts of a write that got no answer
    id_key: bytes | None = None

    def fact_id(self, text: str) -> str:
        return make_fact_id(self.uid, text, None, self.id_key)


@dataclass
class Round:
    index: int
    delay_s: float
    writes_ok: int = 0
    writes_cut: int = 0
    processes_killed: int = 0
    in_flight: list[str] = field(default_factory=list)  # the writes cut by the kill, and whether they took
    left_by_crash: list[str] = field(default_factory=list)
    planted: list[str] = field(default_factory=list)
    checks: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    restart_s: float = 0.0

    def check(self, name: str, ok: bool, problem: str) -> None:
        self.checks[name] = self.checks.get(name, 0) + 1
        if not ok:
            self.problems.append(f"{name}: {problem}")


# ---------------------------------------------------------------- writing until the kill


async def write(http: httpx.AsyncClient, user: UserState, rng: random.Random, counter: list[int]) -> bool:
    """One write on ``user``; True when it was answered 2xx (committed)."""
    op = rng.choice(["add", "add", "add", "delete", "update", "forget"]) if user.facts else "add"
    if op == "add":
        texts = [f"{user.uid.split('@')[0]} noted the {rng.choice(WORDS)} {rng.choice(WORDS)} #{counter[0] + i}."
                 for i in range(rng.randint(1, 3))]
        counter[0] += len(texts)
        new = {user.fact_id(t): t for t in texts}
        user.in_flight = ("add", new, set())
        response = await http.post("/v1/memories", json={"user_id": user.uid, "facts": texts})
        if response.status_code == 201:
            user.facts.update({f["id"]: f["text"] for f in response.json()["results"]})
    elif op == "delete":
        fact_id = rng.choice(list(user.facts))
        user.in_flight = ("delete", {}, {fact_id})
        response = await http.delete(f"/v1/memories/{fact_id}", params={"user_id": user.uid})
        if response.status_code == 200:
            del user.facts[fact_id]
    elif op == "update":
        fact_id = rng.choice(list(user.facts))
        text = user.facts[fact_id].rstrip(".") + f" (updated #{counter[0]})."
        counter[0] += 1
        user.in_flight = ("update", {user.fact_id(text): text}, {fact_id})
        response = await http.put(f"/v1/memories/{fact_id}", json={"user_id": user.uid, "text": text})
        if response.status_code == 200:
            del user.facts[fact_id]
            new = response.json()["result"]
            user.facts[new["id"]] = new["text"]
    else:
        user.in_flight = ("forget", {}, set(user.facts))
        response = await http.delete("/v1/memories", params={"user_id": user.uid})
        if response.status_code == 200:
            user.facts.clear()
    if response.status_code >= 300:
        raise RuntimeError(f"{op} for {user.uid} answered {response.status_code}: {response.text[:300]}")
    user.forgotten = op == "forget"
    user.in_flight = None
    return True


async def writer(http: httpx.AsyncClient, users: list[UserState], rng: random.Random, rnd: Round,
                 counter: list[int]) -> None:
    while True:
        try:
            await write(http, rng.choice(users), rng, counter)
        except httpx.TransportError:
            rnd.writes_cut += 1  # the server was killed under this write
            return
        except RuntimeError as exc:
            rnd.check("every write answered before the kill is a 2xx", False, str(exc))
            return
        rnd.writes_ok += 1


async def write_until_killed(server: Server, users: list[UserState], args, rnd: Round, rng: random.Random) -> None:
    counter = [rnd.index * 100_000]
    owned = [users[i::args.writers] for i in range(args.writers)]
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        tasks = [asyncio.create_task(writer(http, mine, random.Random(rng.random()), rnd, counter)) for mine in owned]
        await asyncio.sleep(rnd.delay_s)
        pids = await asyncio.to_thread(server.kill9)
        await asyncio.gather(*tasks)
    rnd.processes_killed = len(pids)
    alive = [p for p in pids if _alive(p)]
    rnd.check("every process of the server gone", len(pids) >= 3 and not alive, f"{len(pids)} killed, alive: {alive}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# ---------------------------------------------------------------- after the crash


def leftovers(root: Path) -> list[str]:
    """Files no committed state accounts for: temp files, unlisted segments, directories without an index."""
    found = [str(p.relative_to(root)) for p in root.rglob("*.tmp")]
    users = root / "users"
    for directory in users.iterdir() if users.is_dir() else []:
        index = directory / "index.json"
        if not index.is_file():
            found.append(f"{directory.relative_to(root)}/ (no index)")
            continue
        listed = {s["name"] for s in json.loads(index.read_bytes())["segments"]}
        found += [str(p.relative_to(root)) for p in directory.glob("seg-*") if p.name not in listed]
    return sorted(found)


def plant(root: Path, rng: random.Random) -> list[str]:
    """What a crash in the middle of a write leaves: a temp index, a segment written but never
    listed (its index was not committed), and a new user's directory without an index."""
    users = [d for d in (root / "users").iterdir() if (d / "index.json").is_file() and not d.name.startswith("_")]
    victim = rng.choice(users)
    segment = next(victim.glob("seg-*.safetensors"))
    planted = [victim / f".index.json#{rng.randrange(16**8):08x}.tmp", victim / f"seg-{rng.randrange(16**32):032x}.safetensors"]
    planted[0].write_bytes(b'{"format":"inferscale-kv-index","facts":[')  # cut off mid-write
    shutil.copyfile(segment, planted[1])
    ghost = root / "users" / GHOST
    ghost.mkdir(exist_ok=True)
    planted.append(ghost / f"seg-{rng.randrange(16**32):032x}.safetensors")
    shutil.copyfile(segment, planted[2])
    return [str(p.relative_to(root)) for p in planted]


def expected_states(user: UserState) -> list[dict[str, str]]:
    """The fact sets the user may have after the crash: the committed one, or with the write in flight done."""
    states = [dict(user.facts)]
    if user.in_flight is not None:
        kind, adds, removes = user.in_flight
        done = {f: t for f, t in user.facts.items() if f not in removes} | adds
        states.append({} if kind == "forget" else done)
    return states


def settle(user: UserState, found: dict[str, str]) -> None:
    """Take what the server has as the committed state (it matched one of the allowed states)."""
    user.facts, user.in_flight = dict(found), None


# ---------------------------------------------------------------- checks after the restart


async def check_user(http: httpx.AsyncClient, model: str, user: UserState, rnd: Round) -> None:
    response = await http.get("/v1/memories", params={"user_id": user.uid})
    found = {f["id"]: f["text"] for f in response.json()["results"]} if response.status_code == 200 else {}
    if response.status_code not in (200, 404):
        rnd.check("listed", False, f"{user.uid}: GET /v1/memories answered {response.status_code}")
        return
    allowed = expected_states(user)
    lost = set(user.facts) - set(found) - set(user.in_flight[2] if user.in_flight else ())
    rnd.check("no committed fact lost", not lost, f"{user.uid}: lost {sorted(lost)}")
    rnd.check("state is committed or committed + the write in flight, whole", found in allowed,
              f"{user.uid}: has {sorted(found)}, allowed {[sorted(s) for s in allowed]}")
    if user.in_flight is not None:
        rnd.in_flight.append(f"{user.in_flight[0]}: {'took' if found == allowed[-1] != allowed[0] else 'did not take'}")
    settle(user, found)
    if not found:
        return
    chat = {"model": model, "user": user.uid, "max_tokens": 4, "temperature": 0, "inferscale": {"k": len(found)},
            "messages": [{"role": "user", "content": "What did I note?"}]}
    answer = await http.post("/v1/chat/completions", json=chat)
    memory = answer.json().get("inferscale", {}) if answer.status_code == 200 else {}
    report = memory.get("report") or {}
    rnd.check("chat over all facts injects them", answer.status_code == 200 and set(memory.get("fact_ids", [])) == set(found)
              and report.get("fallback") is None and report.get("injected_tokens", 0) > 0,
              f"{user.uid}: {answer.status_code} {json.dumps(memory)[:300]}")


def check_store(root: Path, users: list[UserState], rnd: Round) -> None:
    """Every user's K/V read back whole and verified (segment and index checksums, tensors against the index)."""
    store = DiskStore(DiskStore.Options(root=str(root)))
    listed = set(store.users())
    for user in users:
        if not user.facts:
            rnd.check("forgotten user stays forgotten", user.uid not in listed, f"{user.uid} is listed")
            continue
        try:
            _, kv = store.read_user(user.uid)
            ok, problem = set(kv) == set(user.facts), f"{user.uid}: K/V for {sorted(kv)}"
        except Exception as exc:  # noqa: BLE001 - a failed verification is the finding
            ok, problem = False, f"{user.uid}: {type(exc).__name__}: {exc}"
        rnd.check("K/V verified by the store's checksums", ok, problem)
    rnd.check("the half-written user is not listed", GHOST not in listed, f"{GHOST} is listed")


async def check_after_restart(server: Server, args, users: list[UserState], rnd: Round) -> None:
    root = server.data_dir / "kv"
    left = leftovers(root)
    rnd.check("nothing left over after the restart", not left, f"left: {left}")
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
        listed = (await http.get("/v1/users")).json()["users"]
        rnd.check("the half-written user is not listed", GHOST not in listed, f"/v1/users lists {GHOST}")
        for user in users:
            await check_user(http, args.model, user, rnd)
    check_store(root, users, rnd)


# ---------------------------------------------------------------- rounds


def run_round(server: Server, users: list[UserState], args, rnd: Round, rng: random.Random) -> None:
    asyncio.run(write_until_killed(server, users, args, rnd, rng))
    root = server.data_dir / "kv"
    rnd.left_by_crash = leftovers(root)
    rnd.planted = plant(root, rng)
    rnd.restart_s = server.start()
    asyncio.run(check_after_restart(server, args, users, rnd))
    print(f"round {rnd.index}: killed after {rnd.delay_s:.2f} s, {rnd.writes_ok} writes committed, "
          f"{rnd.writes_cut} cut; crash left {rnd.left_by_crash}; {sum(rnd.checks.values())} checks, "
          f"problems: {rnd.problems or 'none'}", flush=True)


def seed_users(server: Server, users: list[UserState]) -> None:
    key = fact_id_key(load_secret(server.data_dir / "secret"))  # the server made it as it started
    with httpx.Client(base_url=server.url, timeout=300) as http:
        for user in users:
            user.id_key = key
            texts = [f"{user.uid.split('@')[0]} keeps a {w} notebook." for w in WORDS[:3]]
            response = http.post("/v1/memories", json={"user_id": user.uid, "facts": texts})
            response.raise_for_status()
            user.facts = {f["id"]: f["text"] for f in response.json()["results"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (random-weight Qwen2) or what `inferscale serve` takes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--min-delay-s", type=float, default=0.3, help="the kill comes this long after writing starts")
    parser.add_argument("--max-delay-s", type=float, default=4.0, help="... at most; the rounds spread between")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args(argv)
    args.model = resolve_model(args.model)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="serve-faults-", dir=os.environ.get("TMPDIR")))
    server = Server(args.model, work / "data", free_port(), work / "server.log")
    users = [UserState(f"fault-{i}@example.com") for i in range(args.users)]
    spread = [args.min_delay_s + (args.max_delay_s - args.min_delay_s) * (i + rng.random()) / args.rounds
              for i in range(args.rounds)]
    rounds = [Round(i + 1, delay) for i, delay in enumerate(spread)]
    started = time.monotonic()
    try:
        first_start_s = server.start()
        seed_users(server, users)
        for rnd in rounds:
            run_round(server, users, args, rnd, rng)
    finally:
        server.stop()
    ok = all(not r.problems for r in rounds) and all(r.checks for r in rounds)
    command = " ".join(["python benchmarks/serve_faults.py", *(argv if argv is not None else sys.argv[1:])])
    result = {"command": command, "model": args.model, "ok": ok, "first_start_s": first_start_s,
              "total_s": time.monotonic() - started, "rounds": [vars(r) for r in rounds], "server_log": str(server.log)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(out.with_suffix(".md").read_text())
    return 0 if ok else 1


def markdown(result: dict) -> str:
    lines = [f"# Fault run: kill -9 of `inferscale serve` during memory writes\n\n`{result['command']}`\n",
             "| round | killed after | processes killed | writes committed / cut | cut writes after the restart "
             "| left on disk by the crash | checks (failed) | restart |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rounds"]:
        lines.append(f"| {r['index']} | {r['delay_s']:.2f} s | {r['processes_killed']} | {r['writes_ok']} / "
                     f"{r['writes_cut']} | {', '.join(sorted(r['in_flight'])) or '–'} | "
                     f"{', '.join(r['left_by_crash']) or 'nothing'} | {sum(r['checks'].values())} "
                     f"({len(r['problems'])}) | {r['restart_s']:.0f} s |")
    names = sorted({name for r in result["rounds"] for name in r["checks"]})
    lines += ["", "Checks, every round: " + "; ".join(names) + ".", "",
              "All passed." if result["ok"] else "FAILED: " + "; ".join(p for r in result["rounds"] for p in r["problems"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
