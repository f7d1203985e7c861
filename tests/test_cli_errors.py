"""The command line's answer to a mistake is one line, ``inferscale: error: ...`` (or argparse's
usage error), never a traceback; ``-k 0`` is an error, not the default; ``--version``; every
option says what it does."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

import tiny_models
from inferscale import __version__
from inferscale.cli import build_parser


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "inferscale.cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "INFERSCALE_CONFIG": ""})


def assert_one_line_error(out: subprocess.CompletedProcess, needle: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert needle in out.stderr, out.stderr[-2000:]


def test_version():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"inferscale {__version__}"


def _actions(parser: argparse.ArgumentParser, name: str = "inferscale"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _actions(sub, f"{name} {sub_name}")
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield name, action


def test_every_option_has_help_text():
    missing = sorted({f"{name} {'/'.join(a.option_strings) or a.dest}" for name, a in _actions(build_parser())
                      if not a.help})
    assert not missing, missing


@pytest.mark.parametrize("k", ["0", "-3", "1025", "ten"])
def test_a_k_that_is_not_1_to_1024_is_an_error_not_the_default(k):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["ask", "alice", "What is my cat called?", "-k", k])
    assert exc.value.code == 2


def test_a_missing_config_file_is_an_error(tmp_path):
    assert_one_line_error(run("users", "--config", str(tmp_path / "nope.toml")),
                          f"inferscale: error: config file {tmp_path / 'nope.toml'}: No such file or directory")


def test_a_data_dir_that_cannot_be_written_is_an_error(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert_one_line_error(run("facts", "alice", "--data-dir", str(blocked / "memory")), "inferscale: error: ")


@pytest.mark.parametrize("content, needle", [(None, "No such file or directory"),
                                             ("{not json", "not a LoCoMo conversation file"),
                                             (json.dumps({"speaker_a": "A"}), "not a LoCoMo conversation file")])
def test_a_missing_or_malformed_conversation_file_is_an_error(tmp_path, content, needle):
    path = tmp_path / "conv.json"
    if content is not None:
        path.write_text(content)
    model = str(tiny_models.tiny_model_dir("qwen2", "float32"))
    out = run("encode", str(path), "--model", model, "--data-dir", str(tmp_path / "memory"))
    assert_one_line_error(out, needle)
