"""A real `inferscale serve` for the load and fault runs: started, watched, measured, killed.

The server runs as `python -m inferscale.cli serve MODEL --data-dir DATA --port PORT` in its own
process group (the front); the engine is its child in another group (vLLM's API server and its
engine core). ``rss()`` sums the resident memory of the whole tree; ``kill9()`` SIGKILLs every
process of it at once, as a crash or an OOM kill would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def resolve_model(name: str) -> str:
    """``tiny``: the tests' random-weight Qwen2 directory (built once); else the name as given."""
    if name != "tiny":
        return name
    sys.path.insert(0, str(REPO / "tests"))
    import tiny_models

    return str(tiny_models.tiny_model_dir("qwen2", "float32"))


def server_env(tmp: Path) -> dict[str, str]:
    """What the tests give a server: offline, 1 GiB of CPU KV cache, this checkout first."""
    cache = Path(os.environ.get("INFERSCALE_CACHE") or REPO / ".cache")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "TMPDIR": str(tmp), "VLLM_RPC_BASE_PATH": str(tmp), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "MEM0_TELEMETRY": "False"}


@dataclass
class Server:
    """``inferscale serve`` on 127.0.0.1:``port`` with its log in ``log``."""

    model: str
    data_dir: Path
    port: int
    log: Path
    args: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    started: float = 0.0
    _tree: dict[int, psutil.Process] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "inferscale.cli", "serve", self.model, "--data-dir", str(self.data_dir),
                "--port", str(self.port), *self.args]

    def start(self, timeout_s: float = 600.0) -> float:
        """Start and wait until ``/health`` answers 200; seconds it took."""
        tmp = self.log.parent / f"tmp-{self.port}"
        tmp.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.command, env=server_env(tmp), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=REPO)
        while time.monotonic() - self.started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"inferscale serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.started
            time.sleep(1.0)
        raise RuntimeError(f"inferscale serve not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def processes(self) -> list[psutil.Process]:
        """The front and every process under it (the engine's API server, its engine core)."""
        if self.proc is None:
            return []
        try:
            front = self._known(self.proc.pid)
            tree = [front, *front.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        return [self._known(p.pid) for p in tree]

    def rss(self) -> dict[str, int]:
        """Resident bytes per process (``front``, then the engine's by name) and ``total``."""
        out: dict[str, int] = {}
        for i, proc in enumerate(self.processes()):
            with contextlib.suppress(psutil.NoSuchProcess):
                out[_role(proc, i)] = proc.memory_info().rss
        out["total"] = sum(out.values())
        return out

    def kill9(self) -> list[int]:
        """SIGKILL the front and the engine (every process of both groups) at once; their pids."""
        procs = self.processes()
        groups = {os.getpgid(p.pid) for p in procs if p.is_running()}
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self.proc.wait(timeout=30)
        psutil.wait_procs(procs, timeout=30)
        return [p.pid for p in procs]

    def stop(self) -> int | None:
        """SIGTERM the front (it stops the engine), then SIGKILL what is left; the front's exit code."""
        if self.proc is None:
            return None
        procs = self.processes()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill9()
        _, alive = psutil.wait_procs(procs, timeout=30)
        for proc in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        return self.proc.returncode

    def engine_port(self) -> int:
        """The engine's loopback port, from its command line."""
        for proc in self.processes()[1:]:
            cmd = proc.cmdline()
            if "--port" in cmd:
                return int(cmd[cmd.index("--port") + 1])
        raise RuntimeError("no engine process with --port")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def _known(self, pid: int) -> psutil.Process:
        """One psutil handle per pid, so CPU and memory readings stay with their process."""
        if pid not in self._tree:
            self._tree[pid] = psutil.Process(pid)
        return self._tree[pid]


def _role(proc: psutil.Process, index: int) -> str:
    """``front``, ``engine API server:<pid>``, or the process's own name (``VLLM::EngineCore:<pid>``)."""
    if index == 0:
        return "front"
    name = "engine API server" if "api_server" in " ".join(proc.cmdline()) else proc.name()
    return f"{name}:{proc.pid}"
