"""How long stock ``vllm serve`` takes to answer ``/health``, with and without the connector.

    python benchmarks/serve_start.py --shape smoke --cuda-graphs --out benchmarks/results/serve_start.json

Starts vLLM's OpenAI server (random weights of a model shape, no tokenizer)
on 127.0.0.1, first with the InferScale connector, then without, and records
the seconds until ``/health`` answers; with the connector it then sends one
``/v1/completions`` request with memory (token ids, ``kv_transfer_params`` and
the cache salt) and records the connector's report. A server that does not
answer within ``--timeout`` gets SIGABRT (with ``PYTHONFAULTHANDLER=1`` every
process prints its Python stacks into the log) and the log's tail is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ttft import SHAPES, write_memory  # noqa: E402


def bench_salt(config, segment: list[int]) -> str:
    """The cache salt of user "bench"'s segment (keyed with the data directory's secret)."""
    from inferscale.compose.salt import CacheSalts
    from inferscale.storage.disk import DiskStore

    epoch = DiskStore(DiskStore.Options(root=str(config.kv_path))).epoch("bench")
    return CacheSalts.from_file(config.secret_path).segment("bench", epoch, segment, 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str, body: dict | None = None, timeout: float = 2.0) -> dict | None:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode() or "null"
        return json.loads(text) if text.strip().startswith(("{", "[")) else {"status": response.status}


def start(model: Path, extra: list[str], graphs: bool, log: Path, timeout: float) -> tuple[subprocess.Popen, str, float | None]:
    """vLLM's OpenAI server on a model shape with random weights, on 127.0.0.1 (``extra`` last, so
    its options win); (process, URL, seconds until ``/health`` answered, or None)."""
    from inferscale.connector.compat import server_command

    port = free_port()
    cmd = [*server_command(), "--model", str(model), "--load-format", "dummy",
           "--skip-tokenizer-init", "--dtype", "bfloat16", "--max-model-len", "4096", "--gpu-memory-utilization", "0.4",
           "--host", "127.0.0.1", "--port", str(port), *([] if graphs else ["--enforce-eager"]), *extra]
    repo = str(Path(__file__).resolve().parents[1])  # the connector, importable in the engine's processes
    path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", **os.environ, "PYTHONPATH": path, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url, began = f"http://127.0.0.1:{port}", time.monotonic()
    while time.monotonic() - began < timeout and proc.poll() is None:
        try:
            get(f"{url}/health")
            return proc, url, time.monotonic() - began
        except OSError:
            time.sleep(1)
    return proc, url, None


def stop(proc: subprocess.Popen, dump: bool) -> None:
    if proc.poll() is None:
        with_signal = signal.SIGABRT if dump else signal.SIGTERM
        os.killpg(proc.pid, with_signal)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smoke", choices=sorted(SHAPES))
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default="benchmarks/results/serve_start.json")
    args = parser.parse_args()

    from inferscale.compose.request import make_params
    from inferscale.config import BackendSpec, Config
    from inferscale.connector.engine import kv_transfer_config

    work = Path(tempfile.mkdtemp(prefix="inferscale-serve-"))
    cfg = SHAPES[args.shape]
    model = work / f"{args.shape}-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    _, prefix, facts = write_memory(work, cfg, [10], 20, 32)
    config = Config(model=str(model), data_dir=str(work), kv_store=BackendSpec("hbm"), recompute_tokens=0)
    ids = [f"f{i}" for i in range(10)]
    segment = prefix + [t for i in ids for t in facts[i].token_ids]
    runs = {}
    for name, extra in (("with connector", ["--kv-transfer-config", json.dumps(kv_transfer_config(config))]),
                        ("without connector", [])):
        log = Path(os.environ.get("SERVE_LOG_DIR", work)) / f"serve_{name.replace(' ', '_')}.log"
        proc, url, seconds = start(model, extra, args.cuda_graphs, log, args.timeout)
        run = {"health_s": seconds, "log": str(log)}
        if seconds is not None and extra:
            body = {"model": str(model), "prompt": segment + [1000, 1001, 1002, 1003], "max_tokens": 1,
                    "temperature": 0.0, "kv_transfer_params": make_params("bench", ids, 0),
                    "cache_salt": bench_salt(config, segment)}
            try:
                reply = get(f"{url}/v1/completions", body, timeout=120)
                run["report"] = (reply or {}).get("kv_transfer_params")
            except Exception as exc:  # keep going: the start-up time is the point
                run["request_error"] = f"{type(exc).__name__}: {exc}"
        stop(proc, dump=seconds is None)
        if seconds is None:
            run["log_tail"] = log.read_text(errors="replace")[-6000:]
        runs[name] = run
        print(f"{name}: /health after {seconds if seconds is None else round(seconds, 1)} s "
              f"{run.get('report') or run.get('request_error') or ''}", flush=True)
    result = {"shape": args.shape, "cuda_graphs": args.cuda_graphs, "command": " ".join(["python", *sys.argv]),
              "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
