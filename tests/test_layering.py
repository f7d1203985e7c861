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
    ("encode", ("inferscale.retrieval",), "encoding facts does not depend on how they are retrieved"),
]


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


def test_the_rules_see_relative_and_lazy_imports():
    source = "def f():\n    from inferscale.storage.layout import check_ids\nfrom ..compose import request\n"
    names = [name for _, name in imported(PACKAGE / "server" / "probe.py", source)]
    assert "inferscale.storage.layout" in names and "inferscale.compose.request" in names
    assert violations("server", ("inferscale.storage",)) == []
