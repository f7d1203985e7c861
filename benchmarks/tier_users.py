"""1,000 users per GPU: a load whose users' memory does not fit the memory tier, through `vllm serve`.

    # one H100 or H200 (the GPU run; benchmarks/gpu/load_block.sh's users1000 step), ~15 min:
    python benchmarks/tier_users.py --gpu --out benchmarks/results/tier_users_h100
    # the CPU check (tests/test_tier_users.py runs one like it)
    python benchmarks/tier_users.py --shape smoke --users 20 --facts 6 --k 3 --concurrency 4 --clients 1 \\
        --seconds 3 --repeats 1 --warmup-seconds 1 --probes 1 --writes-per-s 4 --budgets 0 \\
        --stores pinned:30%,hbm:all --out /tmp/tier_users

``--gpu`` is ``--shape qwen2.5-7b --cuda-graphs --gpu-memory-utilization 0.4 --kv-dtype-at-rest
fp8_e4m3 --data /tmp/tier_users_data`` on top of the defaults (1,000 users, 60 facts of 20 tokens,
k = 50, Zipf(1.1), 100 clients, 2 writes a second, 3 rounds of 20 s, ``--stores
pinned:default,hbm:all``: the product's default memory tier and budget, then every user in HBM);
a flag given beside it wins. Sized for the H100 machine (about 60 GB of free disk, 128 GiB of
host memory): the qwen2.5-7b shape keeps 28 layers x 4 KV heads x 128 a token, 56 KiB in
bfloat16, 28 KiB in fp8 plus 56 KiB a fact for the offsets and scales. 1,006 users x 60 facts x
20 tokens are then 38 GB of K/V at rest in fp8 (69 GB in bfloat16: more than the disk holds,
hence fp8 at rest); ``pinned:default`` is the product's default budget of pinned host memory, a
quarter of the machine's memory per GPU, counted as page-locked buffers of a power of two each (32
GiB on the H100 machine: 512 of these users at 64 MiB, ~51 %),
``hbm:all`` a tier of every user (38 GB of GPU memory beside vLLM's 40 %). The
users' memory stays in ``--data`` (delete /tmp/tier_users_data afterwards); a second run with the
same sizes reads it back instead of writing it (the writes of the first stay in it), and
``--stores pinned:30% --baseline <first run>.json`` sets a store's rows beside an earlier run's
``hbm:all`` rows. The memory tier is one tier, ``pinned`` or ``hbm``, with the store of record
(disk) behind it: each store is its own engine here. Without ``--data`` the users' memory goes to
a temporary directory, removed at the end.

1. writes the users' memory once (random pre-RoPE K/V of the model shape, ``vllm_serve_load.write_users``,
   kept in ``--kv-dtype-at-rest`` on disk): ``--users`` users, asked for with Zipf(``--zipf``)
   popularity in the order user0, user1, ...; and ``2 x --probes`` users no load asks for;
2. for each ``--stores`` entry (``TIER:BUDGET``: the memory tier ``pinned`` or ``hbm``, its
   ``max_bytes`` a share ``N%`` of the users' K/V, ``all``, ``default`` (the product's budget for
   the tier on this machine) or a size), one `vllm serve` with the connector, that memory tier,
   and the disk store of record behind it (``vllm_serve_load.start_server``); a tier of every
   user is first filled (every user asked for once), then every system runs untimed for
   ``--warmup-seconds`` (the tier reaches its steady state);
3. ``--repeats`` rounds, each running every system once (prompt injection, then KV injection with
   each ``--budgets`` recompute budget) for ``--seconds``: ``--concurrency`` clients in a closed
   loop over ``--clients`` processes, each request for a user drawn by popularity, with k fresh
   facts of theirs (``vllm_serve_load.Requests``, salted with the user's epoch read at the
   request). Before each row the page cache of the store of record's files is dropped
   (``posix_fadvise``), so a user read from disk first comes from the disk itself. During each
   row a writer adds ``--write-facts`` facts to a user drawn by popularity ``--writes-per-s``
   times a second: the write the memory API commits once it has encoded them (the disk store's
   ``put`` of the facts' K/V with their records; random weights cannot encode text, so the
   encoder's own GPU time is not in this run: ``benchmarks/serve_load.py`` writes through the
   whole server). A written user's copy in the memory tier is then another version, and its next
   load reads it from disk again;
4. a cold user's cost: on the idle engine, lone streamed requests (client time to the first token)
   to probe users on disk only (page cache dropped), on disk in the page cache, in the memory
   tier (the same user again), and the same tokens by prompt injection; each with the tier the
   connector counted for it.

Reported per store and system: requests/s (median of the rounds, min-max), its ratio to prompt
injection (within each round) and to the same system with every user in HBM (``hbm:all``, another
engine: medians), engine TTFT (vLLM's histogram: mean, p50/p99 as bucket bounds), the loads per
tier and each tier's share (the connector's ``vllm:inferscale_store_hits_total{tier}``) beside the
share an ideal cache of the budget's users would get, the bytes read per tier and second
(``vllm:inferscale_store_bytes_total{tier}``: a memory tier's tokens written, the store of record's
whole users read), fallbacks, the users asked for, the writes, failed requests; the cold-user
table; the writes' times, and every fact written listed after the run. Writes ``<out>.json`` and
``<out>.md``; exits non-zero when a request failed, a write failed or a written fact is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load_rows  # noqa: E402
import serve_start  # noqa: E402
import tier_rows  # noqa: E402
import vllm_serve_load as vsl  # noqa: E402
from served import REPO  # noqa: E402
from ttft import SHAPES  # noqa: E402

sys.path.insert(0, str(REPO))


class ZipfRequests(vsl.Requests):
    """Requests for users drawn by popularity, each salted with the user's epoch as it is now
    (a writer renews it while the run goes on)."""

    def __init__(self, model: str, config, *args, popularity: tier_rows.Popularity, **kwargs):
        super().__init__(model, config, *args, **kwargs)
        self.popularity = popularity
        self.kv_root = str(config.kv_path)
        self._disk = None

    def user_for(self, slot: str) -> str:
        return self.popularity.draw(self.rng)

    def body(self, system: str, user: str) -> dict:
        if system.startswith("kv@"):
            self.epochs[user] = self.disk().epoch(user)
        return super().body(system, user)

    def disk(self):
        if self._disk is None:
            from inferscale.storage.disk import DiskStore

            self._disk = DiskStore(DiskStore.Options(root=self.kv_root))
        return self._disk

    def __getstate__(self) -> dict:  # (sent to the client processes; each opens the store itself)
        return {**self.__dict__, "_disk": None}


class Writer:
    """Adds facts to users drawn by popularity in the store of record, on a thread, while a row runs."""

    def __init__(self, kv_root: Path, popularity: tier_rows.Popularity, facts: list, per_s: float, seed: int = 1):
        from inferscale.storage.disk import DiskStore

        self.disk = DiskStore(DiskStore.Options(root=str(kv_root)))
        self.popularity, self.facts, self.per_s = popularity, facts, per_s
        self.rng = random.Random(seed)
        self.run = uuid.uuid4().hex[:6]  # fact ids of this run's writes (a --data directory is reused)
        self.added: dict[str, list[str]] = {}
        self.seconds: list[float] = []
        self.errors: list[str] = []

    @property
    def count(self) -> int:
        return len(self.seconds) + len(self.errors)

    @contextlib.contextmanager
    def running(self):
        stop = threading.Event()
        thread = threading.Thread(target=self._loop, args=(stop,), name="tier-users-writer", daemon=True)
        if self.per_s > 0:
            thread.start()
        try:
            yield
        finally:
            stop.set()
            if thread.is_alive():
                thread.join()

    def _loop(self, stop: threading.Event) -> None:
        while not stop.wait(1.0 / self.per_s):
            self.write()

    def write(self) -> None:
        from inferscale.facts import Fact

        user, n = self.popularity.draw(self.rng), self.count
        facts = {f"w{self.run}-{n}-{i}": replace(kv, token_ids=[self.rng.randrange(1000, 100000)
                                                                 for _ in range(kv.num_tokens)])
                 for i, kv in enumerate(self.facts)}
        records = {fid: Fact(fid, user, f"a fact written while the load ran ({fid})", None, kv.token_ids)
                   for fid, kv in facts.items()}
        began = time.perf_counter()
        try:
            self.disk.put(user, facts, records)
        except Exception as exc:  # noqa: BLE001 — a failed write is a result
            self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
            return
        self.seconds.append(time.perf_counter() - began)
        self.added.setdefault(user, []).extend(facts)

    def summary(self) -> dict:
        """The writes, their times, and the facts written that the store no longer lists."""
        lost = {user: sorted(set(fids) - set(self.disk.list(user))) for user, fids in self.added.items()}
        ms = sorted(s * 1e3 for s in self.seconds)
        return {"writes": len(self.seconds), "facts": sum(map(len, self.added.values())), "errors": len(self.errors),
                "error_samples": self.errors[:3], "p50_ms": statistics.median(ms) if ms else None,
                "p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))] if ms else None,
                "lost": sum(map(len, lost.values())), "lost_facts": {u: f for u, f in lost.items() if f},
                "added": self.added}


# ---------------------------------------------------------------- the page cache

def user_dir(kv_root: Path, user: str) -> Path:
    from inferscale.facts import user_file_stem
    from inferscale.storage.disk.store import USERS_DIR

    return kv_root / USERS_DIR / user_file_stem(user)


def drop_page_cache(root: Path) -> int:
    """Ask the kernel to drop the cached pages of every file under ``root`` (clean pages: the store
    fsyncs what it writes), so the next read of them comes from the disk; the files advised."""
    advised = 0
    for path in root.rglob("*"):
        if path.is_file():
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    advised += 1
                finally:
                    os.close(fd)
    return advised


def read_through(root: Path) -> None:
    """Read every file under ``root`` once (into the page cache)."""
    for path in root.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                while f.read(1 << 24):
                    pass


# ---------------------------------------------------------------- one engine

async def fill(url: str, requests: ZipfRequests, system: str, users: list[str], concurrency: int) -> dict:
    """Every user asked for once (``concurrency`` at a time): a memory tier of every user holds them all."""
    client = vsl.make_client(url, concurrency)
    gate = asyncio.Semaphore(concurrency)

    async def ask(user: str) -> dict:
        async with gate:
            return await vsl.one(client, requests, system, user)

    try:
        done = await asyncio.gather(*(ask(u) for u in users))
    finally:
        await client.close()
    return {"users": len(done), "failed": sum(not d["ok"] for d in done),
            "errors": sorted({d["error"] for d in done if not d["ok"]})[:3]}


async def timed_run(pool, url: str, requests: ZipfRequests, system: str, args, writer: Writer, kv_root: Path,
                    seed: tuple) -> dict:
    """One row: the page cache dropped, the writer on, the clients' closed loops for ``--seconds``."""
    slots = [f"slot{i}" for i in range(args.concurrency)]
    drop_page_cache(kv_root)
    before, written = vsl.scrape(url), writer.count
    with writer.running():
        results, cpu = await vsl.timed_row(pool, args.clients, url, requests, system, slots, args.seconds, False, seed)
    await asyncio.sleep(0.5)  # the engine's last stats reach /metrics
    after = vsl.scrape(url)
    row = vsl.summarize(system, args.concurrency, results, args.seconds, args.max_tokens)
    processes = min(args.clients, args.concurrency)
    row.update(vsl.histogram_summary(before, after), writes=writer.count - written,
               connector=tier_rows.counter_delta(vsl.connector_counters(before), vsl.connector_counters(after)),
               asked=sorted({r["user"] for r in results}, key=lambda u: int(u[4:])),
               client_cpu_share=cpu / max(row["seconds"], 1e-9) / processes)
    return row


async def probe(client, url: str, requests: ZipfRequests, system: str, user: str, kind: str) -> dict:
    """One lone streamed request: its client TTFT and the tiers the connector counted for it."""
    before = vsl.connector_counters(vsl.scrape(url))
    result = await vsl.one(client, requests, system, user, stream=True)
    await asyncio.sleep(0.5)
    moved = tier_rows.counter_delta(before, vsl.connector_counters(vsl.scrape(url)))
    return {"kind": kind, "user": user, "system": system, "ok": result["ok"], "error": result.get("error"),
            "ttft_ms": result["ttft"] * 1e3 if result.get("ttft") is not None else None,
            "hits": tier_rows.by_label(moved, "store_hits_total")}


async def cold_users(url: str, requests: ZipfRequests, system: str, probes: list[str], warm_user: str,
                     kv_root: Path) -> list[dict]:
    """A cold user's cost on the idle engine: half the probe users read from the disk itself (and
    then again, from the memory tier), the other half from the page cache; prompt injection beside."""
    client = vsl.make_client(url, 1)
    half = len(probes) // 2
    out = []
    try:
        await vsl.one(client, requests, system, warm_user, stream=True)  # (the streamed path's first use)
        for user in probes[:half]:
            drop_page_cache(user_dir(kv_root, user))
            out.append(await probe(client, url, requests, system, user, "disk"))
            out.append(await probe(client, url, requests, system, user, "memory"))
            out.append(await probe(client, url, requests, load_rows.PROMPT, user, "prompt"))
        for user in probes[half:]:
            read_through(user_dir(kv_root, user))
            out.append(await probe(client, url, requests, system, user, "page_cache"))
    finally:
        await client.close()
    return out


async def load(url: str, requests: ZipfRequests, args, systems: list[str], store: str, fill_all: bool,
               probes: list[str], writer: Writer, kv_root: Path) -> tuple[dict, list[dict], list[dict]]:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    kv = [s for s in systems if s.startswith("kv@")]
    users = requests.popularity.users
    warm = await fill(url, requests, kv[0], users, args.concurrency) if fill_all else {"users": 0, "failed": 0}
    print(f"[{store}] filled: {warm}", flush=True)
    slots = [f"slot{i}" for i in range(args.concurrency)]
    runs = []
    with ProcessPoolExecutor(args.clients, mp_context=get_context("spawn")) as pool:
        for system in systems:  # untimed: the processes start, kernels warm up, the tier fills
            results, _ = await vsl.timed_row(pool, args.clients, url, requests, system, slots, args.warmup_seconds,
                                             False, ("warm", store, system))
            warm["failed"] += sum(not r["ok"] for r in results)
        for repeat in range(args.repeats):
            for system in load_rows.round_order(systems):
                row = await timed_run(pool, url, requests, system, args, writer, kv_root, (store, system, repeat))
                row.update(repeat=repeat, store=store)
                runs.append(row)
                hits = tier_rows.by_label(row["connector"], "store_hits_total")
                print(f"[{store}] #{repeat} {system:12s} {row['requests_per_s']:8.2f} req/s  engine TTFT mean "
                      f"{row.get('ttft_mean_ms', 0):7.1f} ms  hits {hits}  writes {row['writes']}  "
                      f"failed {row['failed']}", flush=True)
    cold = await cold_users(url, requests, kv[0], probes, users[0], kv_root) if probes else []
    return warm, runs, cold


def run_store(args, tier: str, budget: str, model: Path, data: Path, systems: list[str], users: dict,
              writer: Writer, out: Path) -> tuple[dict, list[dict]]:
    """One engine with memory tier ``tier`` of ``budget``: its store summary and its runs."""
    from inferscale.config import BackendSpec, Config

    label = f"{tier}:{budget}"
    max_bytes = tier_rows.budget_bytes(budget, users["user_bytes"], args.users, users["internal_bytes"], tier=tier)
    config = Config(model=str(model), data_dir=str(data), kv_store=BackendSpec(tier, {"max_bytes": max_bytes}),
                    recompute_tokens="adaptive", kv_dtype_at_rest=args.kv_dtype_at_rest, tuning=vsl.tuning_of(args))
    log = out.parent / f"{out.name}_{tier}_{budget.replace('%', 'pct')}_server.log"
    print(f"[{label}] max_bytes {max_bytes / 2**30:.2f} GiB; starting vllm serve (log: {log})", flush=True)
    proc, url = vsl.start_server(model, config, args, log)
    try:
        requests = ZipfRequests(str(model), config, users["prefix"], users["tokens"], args.k, args.question_tokens,
                                args.max_tokens, popularity=writer.popularity)
        warm, runs, cold = asyncio.run(load(url, requests, args, systems, label, budget == "all", users["probes"],
                                            writer, config.kv_path))
    finally:
        serve_start.stop(proc, dump=False)
    holds = min(args.users, (max_bytes - users["internal_bytes"]) / tier_rows.user_footprint(tier, users["user_bytes"]))
    store = {"store": label, "tier": tier, "budget": budget, "max_bytes": max_bytes, "holds_users": holds,
             "ideal_hit_rate": writer.popularity.share(int(holds)), "warm_up": warm,
             "cold_user": tier_rows.cold_summary(cold), "probes": cold}
    return store, runs


# ---------------------------------------------------------------- the users' memory

def users_in(data: Path, args) -> dict:
    """The users' memory under ``data``: written now, or read back when ``data`` holds these users."""
    from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
    from inferscale.storage.disk import DiskStore

    count = args.users + 2 * args.probes
    manifest, kv_root = data / "tier_users.json", data / "kv"
    wanted = {"shape": args.shape, "users": count, "facts": args.facts, "fact_tokens": args.fact_tokens,
              "prefix_tokens": args.prefix_tokens, "kv_dtype_at_rest": args.kv_dtype_at_rest}
    disk = DiskStore(DiskStore.Options(root=str(kv_root)))
    known = json.loads(manifest.read_text()) if manifest.is_file() else None
    began = time.monotonic()
    if known and known["sizes"] == wanted:
        fids = [f"f{f}" for f in range(args.facts)]
        prefix = list(disk.token_ids(SYSTEM_USER, [PREFIX_FACT])[0])
        tokens = {f"user{u}": dict(zip(fids, disk.token_ids(f"user{u}", fids))) for u in range(count)}
        user_bytes = known["user_bytes"]
        print(f"{count} users' memory read back from {kv_root}", flush=True)
    elif disk.users():
        raise SystemExit(f"{kv_root} holds other users' memory (not {wanted}): give an empty --data directory")
    else:
        prefix, tokens = vsl.write_users(data, SHAPES[args.shape], count, args.facts, args.fact_tokens,
                                         args.prefix_tokens, at_rest=args.kv_dtype_at_rest)
        user_bytes = disk.nbytes("user0")
        manifest.write_text(json.dumps({"sizes": wanted, "user_bytes": user_bytes}))
        print(f"{count} users × {args.facts} facts: {count * user_bytes / 2**30:.1f} GiB of K/V written in "
              f"{time.monotonic() - began:.0f} s", flush=True)
    return {"prefix": prefix, "tokens": tokens, "user_bytes": user_bytes,
            "internal_bytes": disk.nbytes(SYSTEM_USER), "probes": [f"user{u}" for u in range(args.users, count)]}


#: ``--gpu``: the engine switches of the H100/H200 run (the module docstring); given flags win
GPU = {"shape": "qwen2.5-7b", "cuda_graphs": True, "gpu_memory_utilization": 0.4, "kv_dtype_at_rest": "fp8_e4m3",
       "data": "/tmp/tier_users_data"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the H100/H200 run: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" if v is not True else f"--{k.replace('_', '-')}" for k, v in GPU.items()))
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    parser.add_argument("--users", type=int, default=1000, help="users asked for (Zipf popularity, user0 first)")
    parser.add_argument("--zipf", type=float, default=1.1, help="the popularity's exponent")
    parser.add_argument("--facts", type=int, default=60, help="facts stored per user")
    parser.add_argument("--fact-tokens", type=int, default=20)
    parser.add_argument("--prefix-tokens", type=int, default=32)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--k", type=int, default=50, help="facts per request")
    parser.add_argument("--stores", default="pinned:default,hbm:all",
                        help="memory tiers, one engine each: TIER:BUDGET with TIER pinned or hbm and BUDGET N%% "
                             "(of the users' K/V), all, default (the product's budget: for pinned a quarter of "
                             "the machine's memory per GPU, for hbm 4 GiB) or a size (4GiB)")
    parser.add_argument("--budgets", default="adaptive",
                        help="recompute budgets of the KV-injection systems (as vllm_serve_load.py's --budgets)")
    parser.add_argument("--concurrency", type=int, default=100, help="clients in the closed loop")
    parser.add_argument("--clients", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 4)),
                        help="client processes, the closed loop's clients spread over them")
    parser.add_argument("--seconds", type=float, default=20.0, help="closed loop per row")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every system")
    parser.add_argument("--warmup-seconds", type=float, default=5.0, help="untimed closed loop per system first")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--writes-per-s", type=float, default=2.0, help="writes while a row runs (0: none)")
    parser.add_argument("--write-facts", type=int, default=1, help="facts added by each write")
    parser.add_argument("--probes", type=int, default=3,
                        help="probe users for a cold user's cost, of each kind (2 x this many users no load asks for)")
    parser.add_argument("--baseline", default=None, metavar="JSON",
                        help="an earlier run's result whose hbm:all rows stand for every user in HBM, when this "
                             "run has none (the same sizes and --data, run just before)")
    parser.add_argument("--data", default=None, help="the data directory (kept; reused when it holds these users; "
                                                     "default: a fresh temporary one)")
    vsl.add_engine_options(parser)
    parser.add_argument("--out", default="benchmarks/results/tier_users")
    parser.add_argument("vllm_args", nargs="*", help="more `vllm serve` arguments (after --)")
    if "--gpu" in (sys.argv[1:] if argv is None else argv):
        parser.set_defaults(**GPU)
    args = parser.parse_args(argv)
    try:
        args.store_list = tier_rows.parse_stores(args.stores)
        args.systems = [load_rows.PROMPT, *vsl.kv_systems(args.budgets)]
    except ValueError as exc:
        parser.error(str(exc))
    if args.k > args.facts or min(args.users, args.concurrency, args.repeats, args.clients) < 1 or args.probes < 0:
        parser.error("need k <= facts, and at least one user, client, round and client process")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.data:
        return run(args, Path(args.data))
    data = Path(tempfile.mkdtemp(prefix="inferscale-tiers-"))
    try:
        return run(args, data)
    finally:
        shutil.rmtree(data, ignore_errors=True)


def run(args, data: Path) -> int:
    """Every store's engine in turn over the users' memory under ``data``; the report; 0 when it checks out."""
    model = data / f"{args.shape}-shape"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(SHAPES[args.shape]))
    users = users_in(data, args)
    popularity = tier_rows.Popularity([f"user{u}" for u in range(args.users)], args.zipf)
    template = vsl.random_facts(SHAPES[args.shape], [args.fact_tokens] * args.write_facts, args.kv_dtype_at_rest, 1)
    writer = Writer(data / "kv", popularity, template, args.writes_per_s)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stores, rows, runs = [], [], []
    for tier, budget in args.store_list:
        store, mine = run_store(args, tier, budget, model, data, args.systems, users, writer, out)
        stores.append(store)
        runs += mine
        rows += tier_rows.store_rows(store["store"], mine)
    baseline = json.loads(Path(args.baseline).read_text())["rows"] if args.baseline else []
    tier_rows.x_all_in_hbm(rows, rows if any(r["store"] == tier_rows.ALL_IN_HBM for r in rows) else baseline)
    result = report(args, users, stores, rows, runs, writer.summary())
    result["baseline"] = args.baseline
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(tier_rows.markdown(result))
    print(tier_rows.markdown(result))
    return 0 if result["checks"]["ok"] else 1


def report(args, users: dict, stores: list[dict], rows: list[dict], runs: list[dict], writes: dict) -> dict:
    from vllm import __version__ as vllm_version

    device = vsl.device_name()
    mode = "CUDA graphs" if args.cuda_graphs else "eager"
    count = args.users + 2 * args.probes
    failed = (sum(r["failed"] for r in runs) + sum(s["warm_up"]["failed"] for s in stores)
              + sum(not p["ok"] for s in stores for p in s["probes"]))
    kv_rows = [r for r in rows if r["system"] != load_rows.PROMPT]
    checks = {"failed_requests": failed, "write_errors": writes["errors"], "lost_facts": writes["lost"],
              "loads_equal_injected": all(r["tiers"]["loads"] == r["tiers"]["injected"] for r in kv_rows)}
    checks["ok"] = failed == 0 and writes["errors"] == 0 and writes["lost"] == 0
    return {"device": device, "vllm": vllm_version,
            "model": f"{args.shape} shape, random weights, bf16, {mode}, vllm serve, {device}",
            "command": " ".join(["python", *sys.argv]), "users": args.users, "probe_users": 2 * args.probes,
            "zipf": args.zipf, "facts_per_user": args.facts, "fact_tokens": args.fact_tokens, "k": args.k,
            "memory_tokens": args.prefix_tokens + args.k * args.fact_tokens, "question_tokens": args.question_tokens,
            "max_tokens": args.max_tokens, "concurrency": args.concurrency, "seconds": args.seconds,
            "repeats": args.repeats, "writes_per_s": args.writes_per_s, "write_facts": args.write_facts,
            "kv_dtype_at_rest": args.kv_dtype_at_rest, "async_loads": vsl.tuning_of(args).async_loads,
            "sizes": {"user_bytes": users["user_bytes"], "user_mib": users["user_bytes"] / 2**20,
                      "all_gib": count * users["user_bytes"] / 2**30},
            "checks": checks, "stores": stores, "rows": rows, "writes": writes, "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
