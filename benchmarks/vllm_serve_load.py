"""Throughput under load through stock `vllm serve` with the connector: query only, KV, prompt injection.

    python benchmarks/vllm_serve_load.py --shape qwen2.5-7b --cuda-graphs --gpu-memory-utilization 0.5 \
        --users 1,10,30,100 --seconds 20 --repeats 3 --out benchmarks/results/vllm_serve_load_h100
    python benchmarks/vllm_serve_load.py --shape smoke --users 1,4 --facts 60 --k 10 --seconds 5   # a CPU check

1. writes ``--facts`` facts of random pre-RoPE K/V (``--fact-tokens`` tokens each) for each of
   ``max(--users)`` users into a fresh data directory (one random buffer for all: the bytes do not
   change the timings; every fact has its own token ids, so every segment has its own salt);
2. starts vLLM's OpenAI server on a model shape with random weights (``--load-format dummy``) and the
   InferScale connector (``--kv-store``, sized to hold every user), and checks that one request of
   every user gets its memory injected (the connector's report);
3. for each number of concurrent users and each system, a closed loop for ``--seconds``: every user
   (spread over ``--clients`` client processes) sends a ``/v1/completions`` request with the
   ``openai`` async client, waits for the whole answer
   (``--max-tokens`` tokens, EOS ignored) and sends the next. Every request draws k fresh facts
   of that user, in random order:

   * ``none``   — the question alone (no memory);
   * ``kv@B``   — ``[prefix | k facts | question]`` with the facts' K/V injected, the last facts that
     fit in B tokens prefilled with the question (``--budgets``: an integer B is the request's own,
     fixed budget; ``adaptive``, the product's default, sends none and the server's connector chooses
     one per request, up to 256 tokens on CUDA while the engine has room and 0 when it is busy, with
     the thresholds ``--tail-max-step-tokens`` / ``--tail-max-waiting``);
   * ``prompt`` — the same token ids prefilled (prompt injection; a fresh cache salt per request, so
     vLLM's prefix cache never serves them).

``--kv-store`` may name several stores side by side (``hbm,pinned:auto``:
``STORE[:ASYNC_LOADS[:PINNED_READS[:BEFORE_FORWARD_TOKENS]]]``, then any other ``[tuning]`` field as
``:FIELD=VALUE``; ``--async-loads`` and ``--pinned-reads`` where a spec names none;
``pinned:never:overlap,pinned:never:copy`` sets two ways of reading host memory side by side,
``pinned:auto,pinned:auto:overlap:2064`` two budgets of loads before the forward pass,
``pinned:never:copy,pinned:never:overlap:pinned_copy_below_mib=0:pinned_copy_above_mib=0`` copies against
in-place reads pipelined by layer group under load):
one server each on the same GPU, started one after the
other (``--gpu-memory-utilization`` is each one's share: 0.36 for two 7B-shape servers on 80 GB, with room for what vLLM does not count), all up
for the whole run; the KV rows become ``kv@B on STORE`` and each round runs every store's rows back to
back, so that the stores are compared within the same minute, not across server starts (the question
alone moved 240-308 req/s between rounds of one start on an H100, more than a 5 % gap); prompt injection
and the question alone run on the first server.

With ``--repeats N`` each number of users runs N rounds, each round every system once in the order
prompt, kv@..., none, and each row reports the median over its rounds with the spread (min-max); its
ratios to prompt injection and to the question alone are taken within each round
(:mod:`load_rows`). Reported per system and number of users: requests/s, the ratios, the recompute
budget the connector chose for each request (its mean and histogram, from the per-request reports),
output tokens/s, the engine's time to the first token (vLLM's own histogram on ``/metrics``: exact
mean, p50/p99 as bucket bounds), the client's latency p50/p99, failed requests. Answers are not
streamed unless ``--stream`` (then no request's report, so no budget, reaches the client): one Python
client parsing a hundred streams of server-sent events (and the API server producing them) limited
requests/s before the engine did, for every system alike. With ``--profile DIR`` py-spy samples the
server's processes during every row (:mod:`engine_profile`): whether the engine's thread, the API server or
the GPU set the pace. Writes ``<out>.json``, ``<out>.md`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_profile  # noqa: E402
import load_rows  # noqa: E402
import serve_start  # noqa: E402
from served import REPO  # noqa: E402
from ttft import SHAPES, kv_shape  # noqa: E402

sys.path.insert(0, str(REPO))


def kv_bytes_per_token(cfg: dict) -> int:
    layers, heads, head_dim = kv_shape(cfg)
    return 2 * layers * heads * head_dim * 2  # K and V, bf16


def write_users(data: Path, cfg: dict, users: int, facts: int, fact_tokens: int, prefix_tokens: int,
                seed: int = 0, at_rest: str = "model") -> tuple[list[int], dict[str, dict[str, tuple[int, ...]]]]:
    """The system prefix and ``facts`` facts for each of ``users`` users, kept in ``at_rest`` (the
    model's dtype or fp8, ``Config.kv_dtype_at_rest``); their token ids."""
    from dataclasses import replace

    from tqdm import tqdm

    from inferscale.compose.segment import PREFIX_FACT, SYSTEM_USER
    from inferscale.kv_fp8 import all_at_rest
    from inferscale.storage.disk import DiskStore

    rng = random.Random(seed)
    disk = DiskStore(DiskStore.Options(root=str(data / "kv")))
    prefix = [rng.randrange(1000, 100000) for _ in range(prefix_tokens)]
    head, *shared = random_facts(cfg, [prefix_tokens] + [fact_tokens] * facts, at_rest, seed)
    disk.put(SYSTEM_USER, {PREFIX_FACT: replace(head, token_ids=prefix)})
    tokens: dict[str, dict[str, tuple[int, ...]]] = {}
    for u in tqdm(range(users), desc="writing users' memory", unit="user"):
        user = f"user{u}"
        mine = {f"f{f}": replace(kv, token_ids=[rng.randrange(1000, 100000) for _ in range(fact_tokens)])
                for f, kv in enumerate(shared)}
        disk.put(user, mine)
        tokens[user] = {fid: tuple(fact.token_ids) for fid, fact in mine.items()}
    return prefix, tokens


def random_facts(cfg: dict, lengths: list[int], at_rest: str = "model", seed: int = 0) -> list:
    """Facts of random pre-RoPE K/V of the model shape, of ``lengths`` tokens each (placeholder
    token ids), in ``at_rest``: every user gets these K/V under ids of its own (the bytes do not
    change the timings; converted to fp8 once, not per user)."""
    import torch

    from inferscale.kv import FactKV
    from inferscale.kv_fp8 import at_rest as kept_as

    layers, heads, head_dim = kv_shape(cfg)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, layers, sum(lengths), heads, head_dim), generator=gen).to(torch.bfloat16)
    facts, start = [], 0
    for length in lengths:
        rows = slice(start, start + length)
        facts.append(kept_as(FactKV(range(length), kv[0][:, rows].clone(), kv[1][:, rows].clone()), at_rest))
        start += length
    return facts


class Requests:
    """Builds each system's request bodies for a user (k fresh facts in random order)."""

    def __init__(self, model: str, config, prefix: list[int], tokens: dict, k: int, question_tokens: int,
                 max_tokens: int, seed: int = 0):
        from inferscale.compose.salt import CacheSalts
        from inferscale.storage.disk import DiskStore

        self.model, self.prefix, self.tokens, self.k = model, prefix, tokens, k
        self.question_tokens, self.max_tokens = question_tokens, max_tokens
        self.salts = CacheSalts.from_file(config.secret_path)
        disk = DiskStore(DiskStore.Options(root=str(config.kv_path)))
        self.epochs = {user: disk.epoch(user) for user in tokens}
        self.rng = random.Random(seed)

    def user_for(self, slot: str) -> str:
        """The user a closed loop's ``slot`` asks for next: always its own here (a subclass may draw one)."""
        return slot

    def body(self, system: str, user: str) -> dict:
        from inferscale.compose.request import make_params

        question = [self.rng.randrange(1000, 100000) for _ in range(self.question_tokens)]
        extra: dict = {"ignore_eos": True}
        if system == "none":
            return {"prompt": question, "extra_body": {**extra, "cache_salt": uuid.uuid4().hex}}
        ids = self.rng.sample(sorted(self.tokens[user]), self.k)
        segment = self.prefix + [t for i in ids for t in self.tokens[user][i]]
        if system == "prompt":
            return {"prompt": segment + question, "extra_body": {**extra, "cache_salt": uuid.uuid4().hex}}
        budget = request_budget(system)
        salt = self.salts.segment(user, self.epochs[user], segment, budget)
        return {"prompt": segment + question,
                "extra_body": {**extra, "cache_salt": salt, "kv_transfer_params": make_params(user, ids, budget)}}


def request_budget(system: str) -> int | None:
    """The budget a ``kv@B`` system's requests carry: B, or none for ``kv@adaptive`` (the connector's own)."""
    budget = split_system(system)[0].split("@")[1]
    return None if budget == "adaptive" else int(budget)


ON = load_rows.ON
#: the stores a server may hold, and the tuning a ``--kv-store`` spec may name after it, in order
STORES = ("hbm", "pinned")
SPEC_TUNING = (("async_loads", ("auto", "always", "never")), ("pinned_reads", ("overlap", "copy")),
               ("before_forward_tokens", "an integer ≥ 0"))


def spec_value(value: str, allowed: tuple[str, ...] | str) -> str | int | None:
    """A spec's value for a tuning field that takes one of ``allowed``, or an integer ≥ 0 (``allowed``
    a description); None when it is neither."""
    if isinstance(allowed, tuple):
        return value if value in allowed else None
    return int(value) if value.isdigit() else None


def split_system(system: str) -> tuple[str, str | None]:
    """``kv@0 on hbm`` → (``kv@0``, ``hbm``); a system of the only (or the first) server → (system, None)."""
    base, _, label = system.partition(ON)
    return base, label or None


def server_specs(value: str) -> list[tuple[str, str, dict[str, str | int | float | bool]]]:
    """``--kv-store`` (comma-separated ``STORE[:ASYNC_LOADS[:PINNED_READS[:BEFORE_FORWARD_TOKENS]]][:FIELD=VALUE...]``)
    as (label, store, the ``Config.tuning`` fields the spec names) per server: the positional values first, then
    any other ``[tuning]`` field by name (``pinned:never:pinned_copy_below_mib=0:pinned_copy_above_mib=0``); a
    ValueError for an unknown store, field or value, or a spec given twice."""
    specs = []
    for spec in filter(None, (part.strip() for part in value.split(","))):
        store, *values = spec.split(":")
        positional = list(itertools.takewhile(lambda v: "=" not in v, values))
        tuning = [spec_value(v, allowed) for v, (_, allowed) in zip(positional, SPEC_TUNING)]
        if store not in STORES or len(positional) > len(SPEC_TUNING) or None in tuning:
            raise ValueError(f"{spec!r}: expected STORE[:ASYNC_LOADS[:PINNED_READS[:BEFORE_FORWARD_TOKENS]]]"
                             f"[:FIELD=VALUE...], STORE one of {', '.join(STORES)}, " + ", ".join(
                                 f"{name.upper()} " + (f"one of {', '.join(allowed)}" if isinstance(allowed, tuple)
                                                       else allowed) for name, allowed in SPEC_TUNING))
        fields = {name: v for v, (name, _) in zip(tuning, SPEC_TUNING)}
        for item in values[len(positional):]:
            name, setting = named_tuning(spec, item)
            if name in fields:
                raise ValueError(f"{spec!r}: {name} given twice")
            fields[name] = setting
        check_tuning(spec, fields)
        specs.append((spec, store, fields))
    if not specs:
        raise ValueError("no store named")
    if len({label for label, _, _ in specs}) < len(specs):
        raise ValueError(f"a store named twice in {value!r}")
    return specs


def named_tuning(spec: str, item: str) -> tuple[str, str | int | float | bool]:
    """``FIELD=VALUE`` of a ``--kv-store`` spec as a ``Config.tuning`` field and its value, read as the
    field's default is typed (``true``/``false``, an integer, a number or a word). A ValueError names
    what is wrong."""
    from inferscale.config import TUNING_KEYS, Tuning

    name, _, text = item.partition("=")
    if name not in TUNING_KEYS:
        raise ValueError(f"{spec!r}: {name!r} is not a [tuning] field")
    kind = type(getattr(Tuning(), name))
    try:
        return name, {"true": True, "false": False}[text] if kind is bool else kind(text)
    except (KeyError, ValueError):
        raise ValueError(f"{spec!r}: {name} takes a {kind.__name__}, got {text!r}") from None


def check_tuning(spec: str, fields: dict) -> None:
    """A ValueError where the fields a spec names are not a tuning the config accepts (checked as it checks them)."""
    from inferscale.config import Tuning
    from inferscale.errors import ConfigError

    try:
        Tuning(**fields)
    except ConfigError as exc:
        raise ValueError(f"{spec!r}: {exc}") from None


def run_systems(kv: list[str], labels: list[str]) -> list[str]:
    """Every system a round runs: the question alone, each KV system on each server (one server:
    the KV systems as named), prompt injection."""
    served = kv if len(labels) == 1 else [f"{system}{ON}{label}" for system in kv for label in labels]
    return ["none", *served, "prompt"]


def kv_systems(budgets: str) -> list[str]:
    """``--budgets`` (comma-separated integers and ``adaptive``) as systems; a ValueError for anything else."""
    systems = []
    for budget in filter(None, budgets.split(",")):
        if budget != "adaptive" and not (budget.isdigit()):
            raise ValueError(f"a budget is an integer >= 0 or 'adaptive', got {budget!r}")
        systems.append(f"kv@{budget if budget == 'adaptive' else int(budget)}")
    return systems


async def one(client, requests: Requests, system: str, user: str, stream: bool = False) -> dict:
    body = requests.body(system, user)
    # the token ids travel in extra_body, which the openai client sends as it is: given as
    # `prompt`, the client walks every id through its request transform (about 9 ms of client
    # CPU per 1,000 ids), and one client process serving every user became the bottleneck
    extra = {**body["extra_body"], "prompt": body["prompt"]}
    start = time.perf_counter()
    first, chunks, report = None, 0, None
    try:
        if stream:
            response = await client.completions.create(model=requests.model, prompt="",
                                                       max_tokens=requests.max_tokens, temperature=0.0, stream=True,
                                                       extra_body=extra)
            async for _ in response:
                chunks += 1
                if first is None:
                    first = time.perf_counter()
        else:
            reply = await client.completions.create(model=requests.model, prompt="",
                                                    max_tokens=requests.max_tokens, temperature=0.0,
                                                    extra_body=extra)
            report = (reply.model_extra or {}).get("kv_transfer_params")
            if reply.choices and reply.choices[0].finish_reason not in ("length", "stop"):
                raise RuntimeError(f"finish_reason {reply.choices[0].finish_reason!r}")
    except Exception as exc:  # noqa: BLE001 — a failed request is a result, not a crash of the benchmark
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300], "t0": start, "t1": time.perf_counter(),
                "user": user}
    end = time.perf_counter()
    return {"ok": True, "t0": start, "t1": end, "ttft": first - start if first else None, "latency": end - start,
            "chunks": chunks, "report": report, "user": user}


async def closed_loop(client, requests: Requests, system: str, users: list[str], seconds: float,
                      stream: bool = False) -> list[dict]:
    """Each user sends a request, waits for the answer, sends the next, until the deadline."""
    deadline = time.perf_counter() + seconds
    done: list[dict] = []

    async def user_loop(slot: str) -> None:
        while time.perf_counter() < deadline:
            done.append(await one(client, requests, system, requests.user_for(slot), stream))

    await asyncio.gather(*(user_loop(u) for u in users))
    return done


def summarize(system: str, users: int, results: list[dict], seconds: float, max_tokens: int) -> dict:
    ok = [r for r in results if r["ok"]]
    failed = [r for r in results if not r["ok"]]
    begin = min((r["t0"] for r in results), default=0.0)
    end = max((r["t1"] for r in results), default=0.0)
    span = max(end - begin, 1e-9)

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        values = sorted(values)
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] * 1e3

    ttfts, latencies = [r["ttft"] for r in ok if r.get("ttft") is not None], [r["latency"] for r in ok]
    reports = [(r.get("report") or {}).get("inferscale") for r in ok]
    return {"system": system, "users": users, "requests": len(ok), "failed": len(failed),
            "errors": sorted({r["error"] for r in failed})[:5], "seconds": span,
            "requests_per_s": len(ok) / span, "output_tokens_per_s": len(ok) * max_tokens / span,
            "client_ttft_p50_ms": pct(ttfts, 0.5), "client_ttft_p99_ms": pct(ttfts, 0.99),
            "latency_p50_ms": pct(latencies, 0.5), "latency_p99_ms": pct(latencies, 0.99),
            **load_rows.budget_summary(reports)}


@dataclass
class Server:
    """One `vllm serve` of the run: its label (the ``--kv-store`` spec), process, URL and connector config."""

    label: str
    proc: subprocess.Popen
    url: str
    config: object


def server_of(system: str, servers: list[Server]) -> Server:
    """The server that runs ``system``: the one its label names, else the first."""
    label = split_system(system)[1]
    return next((server for server in servers if server.label == label), servers[0])


def start_server(model: Path, config, args, log: Path) -> tuple[subprocess.Popen, str]:
    """``serve_start.start`` with the connector and this run's options; an error if it never answers."""
    from inferscale.connector.engine import kv_transfer_config

    extra = ["--kv-transfer-config", json.dumps(kv_transfer_config(config)), "--max-model-len", str(args.max_model_len),
             *(["--gpu-memory-utilization", str(args.gpu_memory_utilization)] if args.gpu_memory_utilization else []),
             *args.vllm_args]
    proc, url, seconds = serve_start.start(model, extra, args.cuda_graphs, log, args.start_timeout)
    if seconds is None:
        serve_start.stop(proc, dump=True)
        raise RuntimeError(f"vllm serve did not answer within {args.start_timeout} s:\n"
                           f"{log.read_text(errors='replace')[-4000:]}")
    print(f"vllm serve answered /health after {seconds:.1f} s", flush=True)
    return proc, url


def make_client(url: str, connections: int):
    from openai import AsyncOpenAI

    import httpx

    limits = httpx.Limits(max_connections=connections + 8, max_keepalive_connections=connections + 8)
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600,
                       http_client=httpx.AsyncClient(limits=limits, timeout=600))


def client_process(url: str, requests: Requests, system: str, users: list[str], seconds: float, stream: bool,
                   seed: tuple) -> tuple[list[dict], float]:
    """One client process's share of a row: its users' closed loops; (results, its CPU seconds)."""
    requests.rng = random.Random(repr(seed))  # every process draws its own facts and questions

    async def loop() -> list[dict]:
        client = make_client(url, len(users))
        try:
            return await closed_loop(client, requests, system, users, seconds, stream)
        finally:
            await client.close()

    cpu = time.process_time()
    results = asyncio.run(loop())
    return results, time.process_time() - cpu


async def timed_row(pool, processes: int, url: str, requests: Requests, system: str, users: list[str],
                    seconds: float, stream: bool, seed: tuple) -> tuple[list[dict], float]:
    """The users' closed loops for ``seconds``, spread over ``processes`` client processes of the
    pool (round-robin); (every result, the clients' CPU seconds)."""
    loop = asyncio.get_running_loop()
    groups = [users[i::processes] for i in range(processes)]
    done = await asyncio.gather(*(loop.run_in_executor(pool, client_process, url, requests, system, group, seconds,
                                                       stream, (*seed, i))
                                  for i, group in enumerate(groups) if group))
    return [r for results, _ in done for r in results], sum(cpu for _, cpu in done)


async def warm_up(servers: list[Server], requests: Requests, systems: list[str], users: list[str]) -> list[dict]:
    """Every user once on every server (not timed): each memory tier loads each user, and the
    reports say what was injected."""
    checks = []
    for server in servers:
        kv = [s for s in systems if s.startswith("kv@") and server_of(s, servers) is server]
        if kv:
            client = make_client(server.url, len(users))
            checks += await asyncio.gather(*(one(client, requests, kv[0], u, stream=False) for u in users))
            await client.close()
    return checks


def counters(servers: list[Server]) -> dict[str, dict[str, float]]:
    """The connector's counters of each server, by label."""
    return {server.label: connector_counters(scrape(server.url)) for server in servers}


def only_or_each(by_label: dict):
    """A run's value per server: the only server's as it is, else each server's by label."""
    return next(iter(by_label.values())) if len(by_label) == 1 else by_label


def counted_since(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict:
    """What each server counted between two :func:`counters` snapshots (:func:`only_or_each`)."""
    return only_or_each({label: {k: v - before[label].get(k, 0.0) for k, v in counts.items()}
                         for label, counts in after.items()})


def per_server(servers: list[Server], name: str):
    """A ``Config.tuning`` field of the run (:func:`only_or_each`)."""
    return only_or_each({server.label: getattr(server.config.tuning, name) for server in servers})


async def run(servers: list[Server], requests: Requests, args, systems: list[str], levels: list[int],
              profilers: dict[str, engine_profile.RowProfiler] | None = None) -> tuple[dict, list[dict]]:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    profilers = profilers or {}
    users = sorted(requests.tokens, key=lambda u: int(u[4:]))
    checks = await warm_up(servers, requests, systems, users)
    injected = [((c.get("report") or {}).get("inferscale") or {}) for c in checks]
    check = {"users": len(checks), "failed": sum(not c["ok"] for c in checks),
             "reports": injected[:2], "errors": sorted({c.get("error", "") for c in checks if not c["ok"]})[:3]}
    print(f"warm-up: {check['users']} users, {check['failed']} failed; first report {injected[:1]}", flush=True)
    # the client runs in --clients processes (one Python process driving a hundred users was the
    # bottleneck on a slow host); untimed, one round per system: the processes start, and CUDA
    # graphs and kernels for each shape warm up
    with ProcessPoolExecutor(args.clients, mp_context=get_context("spawn")) as pool:
        for system in systems:
            await timed_row(pool, args.clients, server_of(system, servers).url, requests, system,
                            users[:4 * args.clients], 1.0, False, ("warm", system))
        before = counters(servers)
        rows = []
        for level, repeat, system in rounds(levels, args.repeats, systems):
            server = server_of(system, servers)
            url, profiler = server.url, profilers.get(server.label)
            snapshot = scrape(url)
            if profiler:
                profiler.start(f"{level}u_{system}_{repeat}".replace(" ", "_"), args.seconds)
            results, cpu = await timed_row(pool, args.clients, url, requests, system, users[:level],
                                           args.seconds, args.stream, (level, system, repeat))
            await asyncio.sleep(0.5)  # the engine's last stats reach /metrics
            row = summarize(system, level, results, args.seconds, args.max_tokens)
            row["repeat"] = repeat
            # the clients' own CPU per request, and per process: near 100 % the clients, not the
            # server, set the pace
            row["client_processes"] = min(args.clients, level)
            row["client_cpu_ms_per_request"] = cpu * 1e3 / max(1, len(results))
            row["client_cpu_share"] = cpu / max(row["seconds"], 1e-9) / row["client_processes"]
            row.update(histogram_summary(snapshot, scrape(url)))
            if profiler:
                row["profile"] = profiler.collect()
            rows.append(row)
            print(f"{level:4d} users {system:{max(map(len, systems))}s} #{repeat} {row['requests_per_s']:8.2f} req/s  B mean "
                  f"{row.get('budget_mean', float('nan')):5.0f}  engine TTFT mean "
                  f"{row.get('ttft_mean_ms', 0):8.1f} ms (p50 ≤ {row.get('ttft_p50_le_ms', 0):.0f}, p99 ≤ "
                  f"{row.get('ttft_p99_le_ms', 0):.0f})  latency p50 {row['latency_p50_ms'] or 0:8.1f} ms  "
                  f"client CPU {100 * row['client_cpu_share']:.0f} %  failed {row['failed']}", flush=True)
            for name, summary in row.get("profile", {}).items():
                print(engine_profile.line(name, summary), flush=True)
    check["connector_counts_during_runs"] = counted_since(before, counters(servers))
    print(f"connector counters during the timed runs: {check['connector_counts_during_runs']}", flush=True)
    return check, rows


def rounds(levels: list[int], repeats: int, systems: list[str]):
    """(users, repeat, system) in the order they run: every repeat of one number of users before the
    next, each repeat one round of every system (:func:`load_rows.round_order`)."""
    order = load_rows.round_order(systems)
    return [(level, repeat, system) for level in levels for repeat in range(repeats) for system in order]


#: vLLM's own per-request histograms (measured in the engine, from the request's arrival there)
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "e2e": "vllm:e2e_request_latency_seconds",
              "queue": "vllm:request_queue_time_seconds"}


def scrape(url: str) -> dict[str, float]:
    """Every sample on the server's ``/metrics``, summed over the labels that only name the model
    and the engine: keyed ``name`` or ``name{label=value}`` for ``le``, ``step``, ``reason``, ``tier``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            kept = [f"{k}={v}" for k, v in sample.labels.items() if k in ("le", "step", "reason", "tier")]
            key = sample.name + (f"{{{','.join(kept)}}}" if kept else "")
            out[key] = out.get(key, 0.0) + sample.value
    return out


def histogram_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """Mean (exact) and p50/p99 (the upper bound of the bucket that holds them) per histogram,
    of the requests finished between the two :func:`scrape` snapshots, in ms."""
    out = {}
    for key, name in HISTOGRAMS.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count <= 0:
            continue
        out[f"{key}_mean_ms"] = (after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / count * 1e3
        prefix = f"{name}_bucket{{le="
        cumulative = sorted((float(k[len(prefix):-1]), v - before.get(k, 0.0)) for k, v in after.items()
                            if k.startswith(prefix))
        for q in (0.5, 0.99):
            bound = next((b for b, c in cumulative if c >= q * count), float("inf"))
            out[f"{key}_p{int(q * 100)}_le_ms"] = bound * 1e3
    return out


def connector_counters(snapshot: dict[str, float]) -> dict[str, float]:
    """The connector's counters in a :func:`scrape` snapshot (injections, fallbacks, store hits, host time)."""
    return {k.removeprefix("vllm:inferscale_"): v for k, v in snapshot.items()
            if k.startswith("vllm:inferscale_") and "_total" in k}


def parked_waits(counts: dict) -> str:
    """The mean wait of the requests parked to load beside the batch, per server (from the
    connector's ``parked_*`` counters); "" when none was parked."""
    by_label = counts if counts and all(isinstance(v, dict) for v in counts.values()) else {"": counts or {}}
    said = []
    for label, c in by_label.items():
        parked = c.get("parked_requests_total", 0.0)
        if parked:
            said.append(f"{label + ': ' if label else ''}{parked:.0f} requests parked, waiting "
                        f"{c.get('parked_schedules_total{until=reported}', 0.0) / parked:.2f} schedules for the "
                        f"workers' report, {c.get('parked_schedules_total{until=scheduled}', 0.0) / parked:.2f} until "
                        f"they ran, {1000 * c.get('parked_seconds_total', 0.0) / parked:.1f} ms")
    return "; ".join(said)


def _clients(rows: list[dict]) -> str:
    most = max((r.get("client_processes", 1) for r in rows), default=1)
    return "one process drives every user" if most == 1 else f"the users spread over up to {most} processes"


def _stores(result: dict) -> str:
    servers = result.get("servers") or []
    if len(servers) < 2:
        return f"KV store {result['kv_store']}"
    each = ", ".join(f"{s['label']} (async_loads {s['async_loads']}, pinned_reads {s['pinned_reads']}"
                     + (f", before_forward_tokens {s['before_forward_tokens']})" if s.get("before_forward_tokens")
                        else ")") for s in servers)
    return (f"KV stores side by side, one `vllm serve` each on one device, every round running each one's rows "
            f"back to back: {each}; prompt injection and the question alone on {servers[0]['label']}'s server")


def table(result: dict) -> str:
    rows = result["rows"]
    counts = result["warm_up"].get("connector_counts_during_runs", {})
    repeats = result.get("repeats", 1)
    servers = result.get("servers") or []
    # side by side: each KV row against the same budget's row on the first store, within each round
    first = f"× kv@B on {servers[0]['label']} | " if len(servers) > 1 else ""
    each = (f"{result['seconds']:.0f} s closed loop per row" if repeats == 1 else
            f"each row the median of {repeats} interleaved rounds of {result['seconds']:.0f} s (min-max; the ratios "
            "taken within each round)")
    lines = [f"# Load through `vllm serve`: {result['model']}", "", f"`{result['command']}`", "",
             f"{result['facts_per_user']} facts a user, k = {result['k']} ({result['memory_tokens']} memory tokens), "
             f"{result['question_tokens']}-token questions, {result['max_tokens']} output tokens, "
             f"{each}, {_stores(result)}. Recompute budget: what the connector chose per request "
             f"(mean, and B: requests), from each request's report; kv@adaptive is the default "
             f"(adaptive tail, thresholds {json.dumps(result.get('tail_thresholds', {}))}). Client CPU: the "
             f"benchmark client's CPU time over the row's span, per client process ({_clients(rows)}; near 100 % "
             "the client, not the server, sets the pace).", "",
             f"| users | system | requests/s | × prompt injection | × question alone | {first}recompute budget | "
             "output tok/s | engine TTFT mean ms | engine TTFT p50 / p99 ≤ ms | queue mean ms | "
             "client latency p50 / p99 ms | client CPU | failed |",
             "|---|---|---|---|---|" + "---|" * bool(first) + "---|---|---|---|---|---|---|---|"]
    if counts:
        waits = parked_waits(counts)
        lines[6:6] = [f"The connector's counters over the timed runs: {json.dumps(counts)}.", ""] + (
            [f"Parked to load beside the batch, the mean wait (from the schedule that parked a request to the "
             f"one that ran it; vLLM's floor is 1 and 2 schedules): {waits}.", ""] if waits else [])
    if result.get("default"):
        lines[6:6] = [f"The default, `{result['default']['method']}`, is served by {result['default']['system']}: "
                      "the same tokens injected and prefilled whatever the facts were encoded behind.", ""]
    for r in rows:
        system = f"{r['system']} (default)" if r.get("method") else r["system"]
        spread = r.get("requests_per_s_spread") or load_rows.spread([r["requests_per_s"]])
        lines.append(f"| {r['users']} | {system} | {load_rows.cell(spread)} | {load_rows.cell(r.get('x_prompt'))} | "
                     f"{load_rows.cell(r.get('x_none'))} | "
                     + (f"{load_rows.cell(r.get('x_first_store'), 3)} | " if first else "")
                     + f"{load_rows.budget_cell(r)} | "
                     f"{r['output_tokens_per_s']:.0f} | {r.get('ttft_mean_ms', 0):.1f} | "
                     f"{r.get('ttft_p50_le_ms', 0):.0f} / {r.get('ttft_p99_le_ms', 0):.0f} | "
                     f"{r.get('queue_mean_ms', 0):.1f} | {r.get('latency_p50_ms') or 0:.1f} / "
                     f"{r.get('latency_p99_ms') or 0:.1f} | {r.get('client_cpu_share', float('nan')):.0%} | "
                     f"{r['failed']} |")
    profile = engine_profile.table(result.get("runs", []))
    if profile:
        lines += ["", "Where the server's processes spent each row (py-spy, `--profile`; benchmarks/engine_profile.py): "
                  "the busiest thread's share of the row at work, busy (waits included) and inside InferScale.", "",
                  profile.rstrip("\n")]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Requests/s and engine TTFT of each system: against the users where a run has several levels,
    else a bar each, with the rounds' spread (min-max) and each row's ratio to prompt injection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    if len({r["users"] for r in rows}) == 1:
        _bars(rows, left, right)
    else:
        for system in dict.fromkeys(r["system"] for r in rows):
            mine = [r for r in rows if r["system"] == system]
            left.plot([r["users"] for r in mine], [r["requests_per_s"] for r in mine], "o-", label=system)
            right.plot([r["users"] for r in mine], [r.get("ttft_mean_ms", 0) for r in mine], "o-", label=system)
        for ax in (left, right):
            ax.set_xlabel("concurrent users")
            ax.set_xscale("log")
            ax.legend(fontsize=8)
    left.set_ylabel("requests/s")
    right.set_ylabel("engine time to first token, mean ms")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(result["model"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _bars(rows: list[dict], left, right) -> None:
    """One level of users: a bar per system, requests/s with the rounds' min-max and its ratio to
    prompt injection (within rounds), and engine TTFT."""
    names = [r["system"] for r in rows]
    rates = [r["requests_per_s"] for r in rows]
    spread = [r.get("requests_per_s_spread") or {"min": rate, "max": rate} for r, rate in zip(rows, rates)]
    errors = [[rate - s["min"] for rate, s in zip(rates, spread)], [s["max"] - rate for rate, s in zip(rates, spread)]]
    left.bar(names, rates, yerr=errors, capsize=4, color="tab:blue")
    for index, row in enumerate(rows):
        ratio = (row.get("x_prompt") or {}).get("median")
        if ratio is not None:
            left.annotate(f"{ratio:.2f}× prompt", (index, spread[index]["max"]), ha="center", va="bottom", fontsize=8,
                          xytext=(0, 6), textcoords="offset points")
    left.set_ylim(top=max(s["max"] for s in spread) * 1.15)  # room for the ratios above the bars
    right.bar(names, [r.get("ttft_mean_ms", 0) for r in rows], color="tab:orange")
    for ax in (left, right):
        ax.set_title(f"{rows[0]['users']} concurrent users", fontsize=9)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine's switches (the ``Config`` and `vllm serve` options a load run sets), which
    :func:`start_server` and :func:`tuning_of` read."""
    parser.add_argument("--tail-max-step-tokens", type=int, default=None,
                        help="Config.tuning.tail_max_step_tokens for kv@adaptive (default: Tuning's)")
    parser.add_argument("--tail-max-waiting", type=int, default=None,
                        help="Config.tuning.tail_max_waiting for kv@adaptive (default: Tuning's)")
    parser.add_argument("--kv-dtype-at-rest", default="model", choices=["model", "fp8_e4m3"],
                        help="Config.kv_dtype_at_rest: the memory tier holds (and the bus carries) fp8 K/V")
    parser.add_argument("--pinned-reads", choices=["copy", "overlap"],
                        help="Config.tuning.pinned_reads (default: Tuning's)")
    parser.add_argument("--async-loads", choices=["auto", "always", "never"],
                        help="Config.tuning.async_loads: memory loaded beside the batch or before the forward "
                             "pass (default: Tuning's)")
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--layerwise-write", action="store_true",
                        help="Config.tuning.fused_write = false (default: the fused write)")
    parser.add_argument("--fused-write", action="store_true", help="Config.tuning.fused_write = true (the default)")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--start-timeout", type=float, default=600)


def tuning_of(args, **overrides):
    """``Config.tuning`` from :func:`add_engine_options`' switches (Tuning's defaults where none was
    given), with ``overrides`` (a ``--kv-store`` spec's) over them."""
    from inferscale.config import Tuning

    given = {name: getattr(args, name) for name in ("tail_max_step_tokens", "tail_max_waiting", "pinned_reads",
                                                    "async_loads") if getattr(args, name) is not None}
    return Tuning(fused_write=not args.layerwise_write, **{**given, **overrides})


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        return "unknown"


def parse_default(spec: str | None, systems: list[str], parser) -> tuple[str, str] | None:
    """``METHOD=SYSTEM`` → (method, system); SYSTEM must be one of the systems run."""
    if not spec:
        return None
    method, _, system = spec.rpartition("=")
    if not method or system not in systems:
        parser.error(f"--default {spec!r}: expected METHOD=SYSTEM with SYSTEM one of {systems}")
    return method, system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    parser.add_argument("--users", default="1,10,30,100", help="concurrent users per row (comma-separated)")
    parser.add_argument("--facts", type=int, default=200, help="facts stored per user")
    parser.add_argument("--fact-tokens", type=int, default=20)
    parser.add_argument("--prefix-tokens", type=int, default=32)
    parser.add_argument("--question-tokens", type=int, default=16)
    parser.add_argument("--k", type=int, default=50, help="facts per request")
    parser.add_argument("--budgets", default="adaptive,0,256",
                        help="recompute budgets B of the KV-injection systems: integers (the request's own, fixed) "
                             "and 'adaptive' (none sent: the connector's default, chosen per request by load)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds per number of users, each running every system once (prompt, kv@..., none); "
                             "each row reports the median over them with the spread")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--seconds", type=float, default=15.0, help="closed loop per row")
    parser.add_argument("--stream", action="store_true", help="stream answers (the client also times the first "
                        "token; at high concurrency the client and the API server's event handling then limit "
                        "requests/s before the engine does)")
    parser.add_argument("--clients", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 4)),
                        help="client processes, the users spread over them (default: a quarter of the cores, 1-4)")
    parser.add_argument("--kv-store", default="hbm", metavar="STORE[:ASYNC_LOADS[:PINNED_READS]],...",
                        help="the store (hbm, pinned), or several side by side on one GPU, a server each, with "
                             "their own async_loads and pinned_reads where named: 'hbm,pinned:auto' (see the module)")
    add_engine_options(parser)
    parser.add_argument("--default", default=None, metavar="METHOD=SYSTEM",
                        help="name the product's default: the accuracy method (as benchmarks/locomo_accuracy.py "
                             "names it) that SYSTEM (e.g. kv@0) serves; its rows and the JSON carry the name")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="sample the server's processes (API server, engine core) with py-spy during every "
                             "timed row into DIR; each row's JSON gets their busy share and hottest functions "
                             "(benchmarks/engine_profile.py; py-spy from $PY_SPY or PATH)")
    parser.add_argument("--out", default="benchmarks/results/vllm_serve_load")
    parser.add_argument("vllm_args", nargs="*", help="more `vllm serve` arguments (after --)")
    args = parser.parse_args(argv)
    levels = [int(u) for u in args.users.split(",")]
    try:
        kv = kv_systems(args.budgets)
    except ValueError as exc:
        parser.error(f"--budgets: {exc}")
    try:
        specs = server_specs(args.kv_store)
    except ValueError as exc:
        parser.error(f"--kv-store: {exc}")
    systems = run_systems(kv, [label for label, _, _ in specs])
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    default = parse_default(args.default, systems, parser)
    spy = engine_profile.py_spy() if args.profile else None
    if args.profile and not spy:
        parser.error("--profile needs py-spy: set PY_SPY to its binary or put it on PATH")

    from inferscale.config import BackendSpec, Config
    from inferscale.storage.pinned import pinned_footprint

    work = Path(tempfile.mkdtemp(prefix="inferscale-load-"))
    cfg = SHAPES[args.shape]
    model = work / f"{args.shape}-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    began = time.monotonic()
    prefix, tokens = write_users(work, cfg, max(levels), args.facts, args.fact_tokens, args.prefix_tokens)
    memory_bytes = max(levels) * args.facts * args.fact_tokens * kv_bytes_per_token(cfg)
    # every user held: a pinned tier counts each user's page-locked buffer, a power of two
    budget = max(levels) * pinned_footprint(args.facts * args.fact_tokens * kv_bytes_per_token(cfg))
    print(f"{max(levels)} users × {args.facts} facts: {memory_bytes / 2**30:.1f} GiB of K/V written in "
          f"{time.monotonic() - began:.0f} s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    try:
        for label, store, tuning in specs:  # one after another: each sizes its KV cache from what is free
            # every kv@B request carries its own budget; kv@adaptive's carry none: the connector's default
            config = Config(model=str(model), data_dir=str(work), recompute_tokens="adaptive",
                            kv_store=BackendSpec(store, {"max_bytes": int(budget * 1.25) + (1 << 30)}),
                            kv_dtype_at_rest=args.kv_dtype_at_rest, tuning=tuning_of(args, **tuning))
            name = f"{out.name}_server" + (f"_{label.replace(':', '_')}" if len(specs) > 1 else "")
            proc, url = start_server(model, config, args, out.parent / f"{name}.log")
            servers.append(Server(label, proc, url, config))
        config = servers[0].config
        requests = Requests(str(model), config, prefix, tokens, args.k, args.question_tokens, args.max_tokens)
        profilers = {s.label: engine_profile.RowProfiler(spy, s.proc.pid, Path(args.profile)) for s in servers} \
            if spy else None
        check, runs = asyncio.run(run(servers, requests, args, systems, levels, profilers))
    finally:
        for server in servers:
            serve_start.stop(server.proc, dump=False)
        shutil.rmtree(work, ignore_errors=True)  # the users' K/V: tens of GB at 100 users
    device = device_name()
    mode = "CUDA graphs" if args.cuda_graphs else "eager"
    from vllm import __version__ as vllm_version

    result = {"device": device, "vllm": vllm_version, "model": f"{args.shape} shape, random weights, bf16, {mode}, vllm serve, {device}",
              "command": " ".join(["python", *sys.argv]), "facts_per_user": args.facts, "k": args.k,
              "memory_tokens": args.prefix_tokens + args.k * args.fact_tokens, "question_tokens": args.question_tokens,
              "max_tokens": args.max_tokens, "seconds": args.seconds, "kv_store": args.kv_store,
              "servers": [{"label": s.label, "kv_store": s.config.kv_store.name,
                           "async_loads": s.config.tuning.async_loads,
                           "pinned_reads": s.config.tuning.pinned_reads,
                           "before_forward_tokens": s.config.tuning.before_forward_tokens,
                           "tuning": s.config.tuning.to_dict()} for s in servers],
              "kv_dtype_at_rest": args.kv_dtype_at_rest,
              "fused_write": not args.layerwise_write, "pinned_reads": per_server(servers, "pinned_reads"),
              "async_loads": per_server(servers, "async_loads"),
              "memory_gib": memory_bytes / 2**30, "repeats": args.repeats,
              "tail_thresholds": {k: getattr(config.tuning, k) for k in ("tail_max_step_tokens", "tail_max_waiting")},
              "warm_up": check, "rows": load_rows.aggregate(runs, specs[0][0]), "runs": runs}
    rows = result["rows"]
    if default:
        result["default"] = {"method": default[0], "system": default[1]}
        for row in (*rows, *runs):
            if row["system"] == default[1]:
                row["method"] = default[0]
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(table(result))
    print(table(result))
    try:
        plot(result, out.with_suffix(".png"))
    except ImportError as exc:  # the numbers matter more than the picture
        print(f"no plot ({exc})")
    return 0 if all(r["failed"] == 0 for r in rows) and check["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
