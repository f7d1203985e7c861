"""N replicas of InferScale on one machine behind vllm-router, with memory on one Redis server.

    python deploy/local_cluster.py MODEL [--replicas 2] [--fronts 1] [--port 8000] [--redis URL]

starts, in order (docs/cluster.md):

1. ``redis-server`` on a free loopback port (unless ``--redis`` names a running one): the
   store of record every process reads and every write commits to;
2. N replicas, ``inferscale engine MODEL``: vLLM with the connector, each with its own memory
   tier (pinned host memory) filled from Redis;
3. ``vllm-router --policy consistent_hash`` in front of them: a request's ``X-Session-ID``
   (set by the fronts, derived from the user with the server secret) picks its replica;
4. the fronts, ``inferscale serve --engine-url <router>``: the memory API and chat, stateless
   (retrieval indexes follow the store's epochs), the first on ``--port``.

Every process shares one config (``<dir>/inferscale.toml``) and one server secret. Ctrl-C stops
everything. Tests and benchmarks use :class:`LocalCluster` directly.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(tmp: Path) -> dict[str, str]:
    """Offline, 1 GiB of CPU KV cache per replica, this checkout first on the path."""
    cache = Path(os.environ.get("INFERSCALE_CACHE") or REPO / ".cache")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CACHE_ROOT": str(cache / "vllm"), "TMPDIR": str(tmp), "VLLM_RPC_BASE_PATH": str(tmp),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "MEM0_TELEMETRY": "False"}


@dataclass
class Process:
    """One started piece: its name, URL, process (its own process group) and log."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Signal the whole process group (a replica's API server, engine core and workers)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


@dataclass
class LocalCluster:
    model: str
    replicas: int = 2
    fronts: int = 1
    directory: Path | None = None
    redis_url: str | None = None
    front_port: int | None = None
    #: vLLM's own arguments for every replica
    vllm_args: tuple[str, ...] = ("--max-model-len", "1024")
    started: dict[str, Process] = field(default_factory=dict)

    # ---------------------------------------------------------------- the pieces

    def start(self) -> LocalCluster:
        self.directory = Path(self.directory or tempfile.mkdtemp(prefix="inferscale-cluster-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.env = environment(self.directory)
        try:
            if self.redis_url is None:
                self.start_redis()
            self.write_config()
            engines = [self._spawn(f"replica{i}", self._engine_cmd(port), f"http://127.0.0.1:{port}")
                       for i, port in enumerate(free_port() for _ in range(self.replicas))]
            for engine in engines:
                self._wait(engine, "/health")
            self.start_router()
            ports = [self.front_port] if self.front_port and self.fronts else []
            while len(ports) < self.fronts:
                port = free_port()
                if port not in ports:  # the ports are picked before any front binds its own
                    ports.append(port)
            fronts = [self._spawn(f"front{i}", self._front_cmd(port), f"http://127.0.0.1:{port}")
                      for i, port in enumerate(ports)]
            for front in fronts:  # started together, as the engines are
                self._wait(front, "/health")
        except BaseException:
            self.stop()
            raise
        return self

    def start_redis(self, port: int | None = None) -> Process:
        port = port or free_port()
        redis = shutil.which("redis-server")
        if redis is None:
            raise RuntimeError("redis-server is not installed (apt-get install -y redis-server)")
        cmd = [redis, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.directory),
               "--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.redis_url = f"redis://127.0.0.1:{port}/0"
        process = self._spawn("redis", cmd, self.redis_url)
        self._wait_port(process, port)
        return process

    def start_router(self) -> Process:
        port = free_port()
        cmd = [_tool("vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", "consistent_hash",
               "--worker-urls", *self.replica_urls, "--health-check-interval-secs", "1",
               "--health-failure-threshold", "1", "--health-success-threshold", "1",
               "--health-check-timeout-secs", "2", "--request-timeout-secs", "120", "--log-level", "warning"]
        return self._wait(self._spawn("router", cmd, f"http://127.0.0.1:{port}"), "/health")

    def write_config(self) -> Path:
        path = self.directory / "inferscale.toml"
        path.write_text(f'data_dir = "{self.directory / "data"}"\nsecret_file = "{self.directory / "secret"}"\n'
                        f'kv_store = "pinned"\n[model]\npath = "{self.model}"\n'
                        f'[store]\nname = "redis"\noptions = {{ url = "{self.redis_url}" }}\n')
        return path

    # ---------------------------------------------------------------- what tests use

    @property
    def config_path(self) -> Path:
        return self.directory / "inferscale.toml"

    @property
    def replica_urls(self) -> list[str]:
        return [p.url for name, p in self.started.items() if name.startswith("replica")]

    @property
    def front_urls(self) -> list[str]:
        return [p.url for name, p in self.started.items() if name.startswith("front")]

    def replica(self, url: str) -> Process:
        return next(p for name, p in self.started.items() if name.startswith("replica") and p.url == url)

    def stop(self) -> None:
        for process in reversed(list(self.started.values())):
            if process.alive():
                process.kill(signal.SIGTERM)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- internals

    def _engine_cmd(self, port: int) -> list[str]:
        return [sys.executable, "-m", "inferscale.cli", "engine", self.model, "--config", str(self.config_path),
                "--port", str(port), *self.vllm_args]

    def _front_cmd(self, port: int) -> list[str]:
        router = self.started["router"].url
        return [sys.executable, "-m", "inferscale.cli", "serve", self.model, "--config", str(self.config_path),
                "--port", str(port), "--engine-url", router, "--engine-retry", "60"]

    def _spawn(self, name: str, cmd: list[str], url: str) -> Process:
        log = self.directory / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.started[name] = Process(name, url, proc, log)
        return self.started[name]

    def _wait(self, process: Process, path: str, timeout_s: float = STARTUP_TIMEOUT_S) -> Process:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not process.alive():
                raise RuntimeError(f"{process.name} exited with {process.proc.returncode}:\n{process.log_text()[-3000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(process.url + path, timeout=2) as response:
                    if response.status == 200:
                        return process
            time.sleep(0.5)
        raise RuntimeError(f"{process.name} not ready after {timeout_s} s:\n{process.log_text()[-3000:]}")

    def _wait_port(self, process: Process, port: int, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
            time.sleep(0.05)
        raise RuntimeError(f"{process.name} did not listen on {port}:\n{process.log_text()[-2000:]}")


def _tool(name: str) -> str:
    """A console script of this Python's environment (vllm-router), else from PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed (pip install 'inferscale-kv[cluster]')")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model directory or known name")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--fronts", type=int, default=1)
    parser.add_argument("--port", type=int, default=8000, help="the first front's port")
    parser.add_argument("--redis", help="a running Redis (redis://host:port/db); default: start one")
    parser.add_argument("--dir", help="config, secret, logs and Redis' data (default: a new temporary directory)")
    args, vllm_args = parser.parse_known_args()
    cluster = LocalCluster(args.model, args.replicas, args.fronts, Path(args.dir) if args.dir else None,
                           args.redis, args.port, tuple(vllm_args) or LocalCluster.vllm_args)
    with cluster:
        print(f"serving on {', '.join(cluster.front_urls)} (router {cluster.started['router'].url}, replicas "
              f"{', '.join(cluster.replica_urls)}, store {cluster.redis_url}); logs in {cluster.directory}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while all(p.alive() for n, p in cluster.started.items() if not n.startswith("replica")):
                time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
