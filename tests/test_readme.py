"""Every fenced code block of README.md and docs/*.md works as pasted, or says why it is not run.

A block's language picks the check:

* ``python``: it compiles and every module it imports resolves (``from inferscale.x import y``:
  ``y`` exists there);
* ``bash`` / ``sh``: every command is one the test knows and parses: ``inferscale ...`` (with the
  command line's own parser), ``./dev demo|test``, ``pip install`` (its extras exist),
  ``python -m MODULE`` / ``python FILE``, ``export``, ``cd``, ``mkdir``;
* ``toml``: it parses, and one made of config keys loads as a :class:`Config`.

An HTML comment on the line before the fence changes that:

* ``<!-- not-run: REASON -->``: not checked (it needs a GPU, a running server, a long run); the
  test is skipped with REASON;
* ``<!-- run: slow -->``: a python block also runs, as a script in a fresh interpreter in an
  empty folder, in a test marked slow;
* ``<!-- run -->``: the same, in the fast tests.

A file holding ``<!-- readme-test: run the python blocks as one script -->`` has all its python
blocks run together, in order (docs/plugins.md: the examples build on each other).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHECKED = ("python", "bash", "sh", "toml")
FENCE = re.compile(r"^```(\w*)\s*$")
MARKER = re.compile(r"^<!--\s*(not-run|run)\s*(?::\s*(.*?))?\s*-->\s*$")
AS_ONE_SCRIPT = "<!-- readme-test: run the python blocks as one script -->"


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # "not-run" / "run"
    note: str | None  # the marker's text after the colon

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}:{self.lang}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, lang = i, fence.group(1)
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(before.strip())
        out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:j]) + "\n",
                         marker.group(1) if marker else None, marker.group(2) if marker else None))
        i = j + 1
    return out


ALL = [b for path in FILES for b in blocks(path) if b.lang in CHECKED]


def test_the_documents_have_checked_blocks():
    assert len(ALL) >= 20 and {b.lang for b in ALL} >= {"python", "bash", "toml"}
    for block in ALL:
        if block.marker == "not-run":
            assert block.note, f"{block.id}: a not-run block says why"


# ---------------------------------------------------------------- python


def python_imports(code: str) -> list[tuple[str, str | None]]:
    """(module, name or None) for every import in the code."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
            found += [(node.module, alias.name) for alias in node.names]
    return found


def check_import(module: str, name: str | None) -> None:
    if not module.startswith("inferscale"):  # third-party: installed, not imported (mem0, vllm are slow)
        top = module.split(".")[0]
        assert importlib.util.find_spec(top) is not None, f"module {top!r} is not installed"
        return
    mod = importlib.import_module(module)
    if name is not None and name != "*" and not hasattr(mod, name):
        assert importlib.util.find_spec(f"{module}.{name}") is not None, f"{module} has no {name!r}"


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "python"], ids=lambda b: b.id)
def test_python_block_compiles_and_its_imports_resolve(block):
    if block.marker == "not-run":
        pytest.skip(block.note)
    compile(block.code, block.id, "exec")
    for module, name in python_imports(block.code):
        check_import(module, name)


def run_script(code: str, cwd: Path, timeout: int) -> None:
    script = cwd / "block.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"


def scripts() -> list:
    """(id, code, slow) of everything that runs."""
    out = []
    for path in FILES:
        found = [b for b in blocks(path) if b.lang == "python"]
        if AS_ONE_SCRIPT in path.read_text():
            out.append(pytest.param("\n".join(b.code for b in found), 120, id=f"{path.relative_to(ROOT)}:all"))
            continue
        for b in found:
            if b.marker == "run":
                slow = (b.note or "").startswith("slow")
                out.append(pytest.param(b.code, 900 if slow else 120, id=b.id,
                                        marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize(("code", "timeout"), scripts())
def test_python_blocks_run(code, timeout, tmp_path):
    run_script(code, tmp_path, timeout)


def test_the_quick_start_runs_and_plugins_md_is_one_script():
    ids = [p.id for p in scripts()]
    assert "docs/plugins.md:all" in ids and any(i.startswith("README.md:") for i in ids), ids


# ---------------------------------------------------------------- shell


SUBSTITUTION = re.compile(r"\$\(([^()]*)\)")


def commands(code: str) -> list[list[str]]:
    """The block's commands as words: continuations joined, comments and blank lines dropped;
    a command substitution ``$(...)`` is a command of its own (and one word where it stands)."""
    joined = re.sub(r"\\\n", " ", code)
    out = []
    for line in joined.splitlines():
        out += [shlex.split(nested) for nested in SUBSTITUTION.findall(line)]
        words = shlex.split(SUBSTITUTION.sub("SUBSTITUTED", line), comments=True)
        if words:
            out.append(words)
    return out


def check_inferscale(args: list[str]) -> None:
    from inferscale.cli import build_parser

    parser = build_parser()
    argv = list(args)
    if len(argv) > 1 and argv[0] == "serve" and not argv[1].startswith("-"):
        argv[1:2] = ["--model", argv[1]]
    try:
        parsed, rest = parser.parse_known_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"`inferscale {' '.join(args)}` does not parse") from exc
    assert not rest or argv[0] == "serve", f"`inferscale {' '.join(args)}`: unknown arguments {rest}"


def check_pip(args: list[str]) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    for word in args:
        if match := re.fullmatch(r"\.\[([\w,-]+)\]", word):
            unknown = set(match.group(1).split(",")) - extras
            assert not unknown, f"pip extras {sorted(unknown)} are not in pyproject.toml ({sorted(extras)})"


def check_python(args: list[str]) -> None:
    words = [w for w in args if not w.startswith("-") or w == "-m"]
    if words[:1] == ["-m"]:
        top = words[1].split(".")[0]
        assert importlib.util.find_spec(top) is not None, f"`python -m {words[1]}`: {top} is not installed"
        if top == "pytest":
            for word in words[2:]:
                if word.startswith("tests/"):
                    assert (ROOT / word.split("::")[0]).exists(), f"{word} does not exist"
    elif words:
        assert (ROOT / words[0]).exists(), f"`python {words[0]}`: no such file"


def check_command(words: list[str]) -> None:
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return
    cmd, args = words[0], words[1:]
    if cmd == "inferscale":
        check_inferscale(args)
    elif cmd == "./dev":
        assert args[:1] and args[0] in ("demo", "test"), f"./dev takes demo or test, got {args}"
    elif cmd == "pip" and args[:1] in (["install"], ["uninstall"]):
        check_pip(args)
    elif cmd in ("python", "python3"):
        check_python(args)
    elif cmd not in ("export", "cd", "mkdir"):
        raise AssertionError(f"`{' '.join(words)}`: a command this test cannot check; "
                             "mark the block <!-- not-run: why -->")


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in ("bash", "sh")], ids=lambda b: b.id)
def test_shell_block_commands_exist(block):
    if block.marker == "not-run":
        pytest.skip(block.note)
    for words in commands(block.code):
        check_command(words)


# ---------------------------------------------------------------- toml


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "toml"], ids=lambda b: b.id)
def test_toml_block_parses(block):
    from inferscale.config import Config
    from inferscale.errors import UnknownBackendError

    if block.marker == "not-run":
        pytest.skip(block.note)
    data = tomllib.loads(block.code)
    if set(data) <= {f for f in Config.__dataclass_fields__}:
        try:
            Config.from_dict(data)
        except UnknownBackendError as exc:
            # a guide's own example backends: its script registers them (test_python_blocks_run)
            defined = "".join(b.code for b in ALL if b.path == block.path and b.lang == "python")
            if f'name = "{exc.name}"' not in defined:
                raise


def test_the_example_config_is_every_default():
    from inferscale.config import Config

    assert Config.from_toml(ROOT / "inferscale.toml").to_dict() == Config().to_dict()
