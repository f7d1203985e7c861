"""Where a load row's host time goes: py-spy samples of the server's Python processes.

Under load, vLLM's engine core thread (the scheduler, the connector's scheduler side, the model
runner's host work) can set the pace of every step instead of the GPU, and one API server process
parses every request and answer. ``vllm_serve_load.py --profile DIR`` samples each of the server's
processes with py-spy (https://github.com/benfred/py-spy, not a Python dependency: the binary named
by ``$PY_SPY`` or found on ``PATH``) during every timed row, without stopping them
(``--nonblocking``), into ``DIR/<users>u_<system>_<round>_<process>.txt`` (py-spy's raw collapsed
stacks, one thread per stack root), and :func:`summarize` reads one back:

* ``busy``: the busiest thread's samples over the samples a row of that length holds at the rate:
  the share of the row it was not idle (a thread spinning on the GPU counts as busy: its frames
  say where, e.g. a synchronize);
* ``waiting``: the part of ``busy`` spent in a waiting function (:data:`WAITS`, by exact name:
  spinning on a queue, a condition, a socket or the GPU), and ``working`` the rest: the thread's
  real host work;
* ``self``: the functions the busiest thread was in (leaf frames), as shares of the row;
* ``inferscale``: the share of the row inside InferScale's own code (any frame of the package);
* ``eager``: the share of the row in forward passes vLLM ran without its CUDA graphs (a stack through
  vLLM's ``CUDAGraphWrapper`` that replays nothing: steps larger than any size it captured a graph
  for, such as a burst of prefills), whose kernels the host launches one by one.

    PY_SPY=/path/to/py-spy python benchmarks/vllm_serve_load.py ... --profile /tmp/run/profile
    python benchmarks/engine_profile.py /tmp/run/profile/100u_kv@0_0_EngineCore.txt   # one file's summary
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

#: samples a second
RATE = 100
#: leaf functions that wait, by their whole name (vLLM's shared-memory queues spin on sched_yield; torch
#: waits for the GPU in synchronize); a name that only contains one (wait_for_layer_load) counts as work,
#: and so does any function of InferScale's own (HeldBlocks.select)
WAITS = frozenset({"sched_yield", "wait", "_wait", "acquire_read", "dequeue", "poll", "select", "synchronize",
                   "recv", "recv_multipart", "sleep"})
_OURS = re.compile(r"[(/]inferscale/")  # py-spy names a file relative to its sys.path entry
_GRAPH_WRAPPER = "CUDAGraphWrapper.__call__"
_THREAD = re.compile(r"^(?:process \d+:[^;]*;)?thread \((0x[0-9A-Fa-f]+)\)")


def py_spy() -> str | None:
    """The py-spy binary: ``$PY_SPY``, else the one on PATH (None: no profile)."""
    found = os.environ.get("PY_SPY") or shutil.which("py-spy")
    return found if found and os.access(found, os.X_OK) else None


def server_processes(root_pid: int) -> dict[str, int]:
    """The server's Python processes by name: the root (``APIServer``: `vllm serve` answers HTTP
    there with one API server) and each child whose process title vLLM set (``VLLM::EngineCore``
    → ``EngineCore``)."""
    import psutil

    root = psutil.Process(root_pid)
    found = {"APIServer": root_pid}
    for child in root.children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if title.startswith("VLLM::"):
            found[title.split("::", 1)[1].split()[0]] = child.pid
    return found


class RowProfiler:
    """Samples the server's processes (:func:`server_processes` of ``root_pid``) row by row into ``out``."""

    def __init__(self, binary: str, root_pid: int, out: Path):
        self.binary, self.out = binary, out
        self.pids = server_processes(root_pid)  # the server is up: its processes stay for the run
        self._running: list[tuple[str, Path, subprocess.Popen]] = []
        self._seconds = 0.0

    def start(self, tag: str, seconds: float) -> None:
        """One recorder per process for ``seconds`` (the row's length), writing ``out/<tag>_<name>.txt``."""
        self.out.mkdir(parents=True, exist_ok=True)
        self._seconds = seconds
        for name, pid in self.pids.items():
            path = self.out / f"{tag}_{name}.txt"
            command = [self.binary, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                       "--rate", str(RATE), "--nonblocking", "--threads", "--format", "raw", "-o", str(path)]
            self._running.append((name, path, subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                                               stderr=subprocess.DEVNULL)))

    def collect(self, timeout: float = 30.0) -> dict[str, dict | None]:
        """Wait for the row's recorders; each process's :func:`summarize`."""
        found = {}
        for name, path, rec in self._running:
            try:
                rec.wait(timeout)
            except subprocess.TimeoutExpired:
                rec.kill()
            found[name] = summarize(path, self._seconds)
        self._running = []
        return found


def summarize(path: Path, seconds: float, rate: int = RATE, top: int = 8) -> dict | None:
    """A raw file's busiest thread: its busy share, its leaf functions and InferScale's share of
    the row (None: no file, e.g. py-spy could not attach)."""
    if not path.exists():
        return None
    threads: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = {}
    ours: Counter[str] = Counter()
    eager: Counter[str] = Counter()
    waits: Counter[str] = Counter()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        match = _THREAD.match(stack)
        thread = match.group(1) if match else "?"
        threads[thread] += n
        leaf = stack.rsplit(";", 1)[-1]
        leaves.setdefault(thread, Counter())[_frame(leaf)] += n
        if _waits(leaf):
            waits[thread] += n
        if _OURS.search(stack):
            ours[thread] += n
        if _runs_without_graphs(stack):
            eager[thread] += n
    if not threads:
        return {"busy": 0.0, "waiting": 0.0, "working": 0.0, "self": [], "inferscale": 0.0, "eager": 0.0}
    busiest, samples = threads.most_common(1)[0]
    expected = max(1.0, seconds * rate)
    waiting = waits[busiest]
    return {"busy": round(samples / expected, 3), "waiting": round(waiting / expected, 3),
            "working": round((samples - waiting) / expected, 3), "threads": len(threads),
            "self": [(name, round(n / expected, 3)) for name, n in leaves[busiest].most_common(top)],
            "inferscale": round(ours[busiest] / expected, 3), "eager": round(eager[busiest] / expected, 3)}


def _runs_without_graphs(stack: str) -> bool:
    """Whether a stack is in a forward pass vLLM's CUDA-graph wrapper runs without replaying a graph."""
    _, wrapper, inner = stack.partition(_GRAPH_WRAPPER)
    return bool(wrapper) and "replay" not in inner


def _waits(frame: str) -> bool:
    """Whether a leaf frame waits: its function's name is one of :data:`WAITS`, outside InferScale."""
    return frame.split(" (", 1)[0].rsplit(".", 1)[-1] in WAITS and not _OURS.search(frame)


def _frame(frame: str) -> str:
    """``function (path/to/file.py:line)`` as ``function (file.py)``."""
    name, _, where = frame.partition(" (")
    return f"{name} ({Path(where.rstrip(')').rsplit(':', 1)[0]).name})" if where else name


def line(name: str, summary: dict | None) -> str:
    if summary is None:
        return f"  {name}: no profile"
    leaves = ", ".join(f"{f} {100 * s:.0f}%" for f, s in summary["self"][:4])
    return (f"  {name}: working {100 * summary['working']:.0f}% of the row (busy "
            f"{100 * summary['busy']:.0f}%), InferScale {100 * summary['inferscale']:.1f}%; {leaves}")


def table(runs: list[dict]) -> str:
    """Markdown: per users, system and process, the median over the rounds of the busiest thread's
    working / busy / InferScale shares (min-max of working), and its hottest functions in the first round."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        for name, summary in (run.get("profile") or {}).items():
            if summary is not None:
                groups.setdefault((run["users"], run["system"], name), []).append(summary)
    if not groups:
        return ""
    lines = ["| users | system | process | working % of the row (min-max) | busy % | InferScale % | forward without CUDA graphs % "
             "| hottest functions (first round) |",
             "|---|---|---|---|---|---|---|---|"]
    for (users, system, name), found in groups.items():
        working = sorted(100 * s["working"] for s in found)
        hottest = ", ".join(f"{f} {100 * share:.1f}" for f, share in found[0]["self"][:4])
        lines.append(f"| {users} | {system} | {name} | {statistics.median(working):.0f} ({working[0]:.0f}-{working[-1]:.0f}) | "
                     f"{statistics.median([100 * s['busy'] for s in found]):.0f} | "
                     f"{statistics.median([100 * s['inferscale'] for s in found]):.1f} | "
                     f"{statistics.median([100 * s.get('eager', 0.0) for s in found]):.1f} | {hottest} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(arg)
        print(json.dumps(summarize(Path(arg), float(os.environ.get("SECONDS_ROW", "15"))), indent=1))
