"""The engine's output, relayed line by line to the front's own stdout and stderr.

One report is dropped, and only while the front is stopping the engine: vLLM's API server
(0.32) stops its engine core before it cancels the task that reads the core's outputs, so
every stop after a served request logs ``AsyncLLM output_handler failed`` with an
``EngineDeadError`` traceback, though nothing failed. The front says so in one line
instead. Anything else, and any such report while the engine is not being stopped, passes
as it is; a report that does not end as expected is passed on whole.
"""

from __future__ import annotations

import logging
import threading
from typing import BinaryIO

logger = logging.getLogger(__name__)

#: the first and the last line of vLLM's report of its engine core gone on the way out
NOISE_START = b"AsyncLLM output_handler failed."
NOISE_END = b"EngineDeadError"
#: lines a report may take at most; a longer one is not that report and passes whole
NOISE_MAX_LINES = 40


class EngineLog:
    """Relays the engine's pipes; :meth:`stopping` marks the start of its shutdown."""

    def __init__(self):
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def relay(self, pipe: BinaryIO, out: BinaryIO, name: str) -> None:
        """Copy ``pipe`` to ``out`` in a thread until the engine closes it."""
        thread = threading.Thread(target=self._copy, args=(pipe, out), daemon=True, name=f"engine-{name}")
        thread.start()
        self._threads.append(thread)

    def stopping(self) -> None:
        self._stopping.set()

    def join(self, timeout_s: float = 5.0) -> None:
        """Wait until the engine's last lines are written out."""
        for thread in self._threads:
            thread.join(timeout_s)

    def _copy(self, pipe: BinaryIO, out: BinaryIO) -> None:
        held: list[bytes] = []
        with pipe:
            for line in iter(pipe.readline, b""):
                if held or (self._stopping.is_set() and NOISE_START in line):
                    held.append(line)
                    if NOISE_END in line:
                        logger.info("the engine's API server reported its engine core gone as it stopped "
                                    "(vLLM's shutdown order, not a failure; traceback not shown)")
                        held = []
                    elif len(held) > NOISE_MAX_LINES:
                        _write(out, b"".join(held))
                        held = []
                    continue
                _write(out, line)
        if held:
            _write(out, b"".join(held))


def _write(out: BinaryIO, data: bytes) -> None:
    try:
        out.write(data)
        out.flush()
    except (OSError, ValueError):  # the front's own output is gone: nothing to show it on
        pass
