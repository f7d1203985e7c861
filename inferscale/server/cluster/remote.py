"""An engine this front does not start: a router in front of replicas (``vllm-router``), or a
replica on another machine (``inferscale serve --engine-url``). The front waits until it can
serve — one replica up, as the router's ``/workers`` lists them (its ``/health`` is 503 while any
one is down), or the engine's own ``/health`` — and never stops it; the replicas are started
with ``inferscale engine``."""

from __future__ import annotations

import json
import logging
import time
import urllib.request

from inferscale.server.engine.launch import EngineError

logger = logging.getLogger(__name__)


class RemoteEngine:
    """The :class:`~inferscale.server.engine.launch.EngineProcess` calls the front makes, for a URL."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def start(self) -> None:
        logger.info("the engine is %s (not started here)", self.url)

    def exit_code(self) -> int | None:
        return None  # not ours: the router takes a dead replica out

    def wait_ready(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self._ready():
                return time.monotonic() - start
            time.sleep(0.5)
        raise EngineError(f"{self.url}: no replica was ready within {timeout_s:.0f} s")

    def _ready(self) -> bool:
        workers = _get(f"{self.url}/workers")
        if isinstance(workers, dict) and isinstance(workers.get("workers"), list):
            return any(isinstance(w, dict) and w.get("is_healthy") is True for w in workers["workers"])
        return _get(f"{self.url}/health") is not None

    def stop(self, timeout_s: float = 30.0) -> None:
        pass


def _get(url: str) -> object | None:
    """The JSON (or True for any other body) of a 200 answer; None for anything else."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            body = response.read()
    except OSError:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return True
