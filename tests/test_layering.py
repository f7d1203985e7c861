"""Which parts of the package may import which, and that no import runs in a ring: the rules are read
off every module's source (ast, nothing imported), lazy imports inside functions included."""

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
    line (relative imports resolved; of ``from a import b``, both ``a`` and ``a.b``)."""
    found = []
    for node, base, names in _imports(path, source):
        found += [(node.lineno, name) for name in names] if base is None else \
            [(node.lineno, base)] + [(node.lineno, f"{base}.{name}") for name in names]
    return found


def _imports(path: Path, source: str | None):
    """(node, the ``from`` module or None for a plain import, the names) for every import in the module."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            yield node, None, [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            yield node, base, [alias.name for alias in node.names]


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


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module → the package's modules it imports (lazy imports included; ``from a import b`` is an
    import of the module ``a.b`` when there is one, else of ``a``). ``sources`` replaces or adds
    modules' text (by module name), for probing the walk."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    texts = {name: None for name in paths} | (sources or {})
    graph = {}
    for name, text in texts.items():
        path = paths.get(name) or PACKAGE.parent.joinpath(*name.split(".")).with_suffix(".py")
        graph[name] = {t for t in _imported_modules(path, text, texts) if t != name}
    return graph


def _imported_modules(path: Path, text: str | None, modules) -> set[str]:
    """The package's modules the module at ``path`` imports: of ``from a import b``, ``a.b`` if it
    is a module, else ``a``."""
    found = set()
    for _, base, names in _imports(path, text):
        if base is None:
            found.update(_module_of(name, modules) for name in names)
        else:
            found.update(f"{base}.{name}" if f"{base}.{name}" in modules else _module_of(base, modules)
                         for name in names)
    return found - {None}


def _module_of(name: str, modules) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected parts of more than one node (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while not part or part[-1] != node:
                        part.append(stack.pop()), on_stack.discard(part[-1])
                    if len(part) > 1:
                        found.append(sorted(part))
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target), on_stack.add(target)
                work.append((target, iter(sorted(graph.get(target, ())))))
            elif target in on_stack:
                low[node] = min(low[node], index[target])
    return sorted(found)


def part_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same imports between the package's parts: its folders, and each module at its top."""
    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])
    parts: dict[str, set[str]] = {}
    for module, targets in graph.items():
        parts.setdefault(part(module), set()).update(part(t) for t in targets if part(t) != part(module))
    return parts


def test_no_module_imports_itself_through_others():
    assert not cycles(import_graph()), "import cycles (each line: modules that import each other, in a ring):\n" + \
        "\n".join(" ↔ ".join(c) for c in cycles(import_graph()))


def test_no_part_of_the_package_imports_itself_through_others():
    """A folder that imports a folder that imports it back is two layers tangled, even where no
    single module closes a ring (``compose`` → ``storage`` → ``config`` → ``compose`` was one)."""
    parts = part_graph(import_graph())
    assert not cycles(parts), "\n".join(" ↔ ".join(c) for c in cycles(parts))


def test_the_cycle_walk_sees_a_ring():
    probe = {"inferscale.compose.probe_a": "def f():\n    from .probe_b import x\n",
             "inferscale.compose.probe_b": "from inferscale.storage import probe_c\n",
             "inferscale.storage.probe_c": "import inferscale.compose.probe_a\n"}
    graph = import_graph(probe)
    assert ["inferscale.compose.probe_a", "inferscale.compose.probe_b", "inferscale.storage.probe_c"] in cycles(graph)
    assert any({"inferscale.compose", "inferscale.storage"} <= set(ring) for ring in cycles(part_graph(graph)))
    assert "inferscale" not in import_graph({"inferscale.probe": "from inferscale import files\n"})["inferscale.probe"]
