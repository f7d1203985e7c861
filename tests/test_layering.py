"""Which parts of the package may import which: the rules are read off every module's source (ast),
lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "inferscale"
#: (the modules under this folder, must import nothing from these packages, why)
RULES = [
    ("server", ("inferscale.storage", "inferscale.encode", "inferscale.compose"),
     "the server goes through the API (inferscale.api) and the package's public names"),
    ("encode", ("inferscale.retrieval", "inferscale.mem0"),
     "encoding facts depends neither on how they are retrieved nor on Mem0 (inferscale.mem0 imports the core)"),
    ("retrieval", ("inferscale.storage",), "retrieval indexes vectors it is given; where facts are stored is not its concern"),
]
#: the one part of the core that may import inferscale.mem0, and then only the package itself (its door)
MEM0_DOOR = ("api", "inferscale.mem0")


def imported(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """Every module the module at ``path`` (its text: ``source``, or the file's) imports, with its
    line (relative imports resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            found += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for line, name in imported(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return sorted(set(bad))


@pytest.mark.parametrize(("folder", "forbidden", "why"), RULES, ids=[r[0] for r in RULES])
def test_a_layer_imports_only_what_it_may(folder, forbidden, why):
    assert not violations(folder, forbidden), f"{why}:\n" + "\n".join(violations(folder, forbidden))


def mem0_imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """What of ``inferscale.mem0`` the module at ``path`` imports: the package (a name it exports
    counts as the package) or a module in it."""
    found = set()
    for line, name in imported(path, source):
        if name.startswith("inferscale.mem0."):
            module = name.split(".")[2]
            is_module = (PACKAGE / "mem0" / f"{module}.py").exists() or (PACKAGE / "mem0" / module).is_dir()
            found.add((line, f"inferscale.mem0.{module}" if is_module else "inferscale.mem0"))
        elif name == "inferscale.mem0":
            found.add((line, name))
    return sorted(found)


def mem0_violations() -> list[str]:
    """Imports of inferscale.mem0 from the core: anywhere but the facade, or of a module behind its door."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = path.relative_to(PACKAGE).parts[0]
        if part == "mem0":
            continue
        for line, name in mem0_imports(path):
            if part != MEM0_DOOR[0] or name != MEM0_DOOR[1]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return bad


def test_only_the_facade_imports_mem0_and_only_through_its_door():
    assert not mem0_violations(), ("Mem0 is a part of its own (inferscale.mem0, which imports the core); the core "
                                   "reaches it only from inferscale.api, by the names the package exports:\n"
                                   + "\n".join(mem0_violations()))


def test_the_mem0_rule_sees_what_breaks_it():
    probe = ("def f():\n    from ..mem0.store import attach\nimport inferscale.mem0.extract\nfrom inferscale import mem0\n"
             "from inferscale.mem0 import forget_user, provider\n")
    assert mem0_imports(PACKAGE / "api" / "probe.py", probe) == [
        (2, "inferscale.mem0.store"), (3, "inferscale.mem0.extract"), (4, "inferscale.mem0"), (5, "inferscale.mem0"),
        (5, "inferscale.mem0.provider")]
    assert not [p for p in PACKAGE.rglob("mem0_*") if p.relative_to(PACKAGE).parts[0] != "mem0"]


def test_the_rules_see_relative_and_lazy_imports():
    source = "def f():\n    from inferscale.storage.layout import check_ids\nfrom ..compose import request\n"
    names = [name for _, name in imported(PACKAGE / "server" / "probe.py", source)]
    assert "inferscale.storage.layout" in names and "inferscale.compose.request" in names
    assert violations("server", ("inferscale.storage",)) == []
