"""An engine this front does not start: a router in front of replicas (``vllm-router``), or a
replica on another machine (``inferscale serve --engine-url``). The front waits for its
``/health`` and never stops it; the replicas are started with ``inferscale engine``."""

from __future__ import annotations

import logging
import time
import urllib.request

from inferscale.server.launch import EngineError

logger = logging.getLogger(__name__)


class RemoteEngine:
    """The :class:`~inferscale.server.launch.EngineProcess` calls the front makes, for a URL."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def start(self) -> None:
        logger.info("the engine is %s (not started here)", self.url)

    def exit_code(self) -> int | None:
        return None  # not ours: the router takes a dead replica out

    def wait_ready(self, timeout_s: float) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(0.5)
        raise EngineError(f"{self.url}/health did not answer 200 within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        pass
