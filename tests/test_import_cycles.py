"""No import cycle inside locus/ (issue 42): every `import` of a locus module, at module level or
inside a function, is an edge of one graph, and that graph has no cycle. A function-level import
does not break a cycle, it only hides it: the two modules still cannot be understood, or moved,
one without the other. Imports under `if TYPE_CHECKING:` are annotations only (never executed) and
are not edges."""

from __future__ import annotations

import ast
from pathlib import Path

import locus

ROOT = Path(locus.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def imports_of(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The locus modules `path` imports: `from a.b import c` names module a.b.c when c is one,
    else module a.b; relative imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in executed_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import locus.a.b.c` where c is a name, not a module
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("locus"):
                found.add(target)
    return found


def executed_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:` (their `else` branch is kept)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_type_checking_imports_are_not_edges():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nelse:\n    import b\nimport c\n")
    names = {a.name for node in executed_nodes(tree) if isinstance(node, ast.Import) for a in node.names}
    assert names == {"b", "c"}


def test_an_import_inside_a_function_is_an_edge(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from locus import b\n    return b\n")
    (tmp_path / "b.py").write_text("def g():\n    import locus.a\n    return locus.a\n")
    known = {"locus.a": tmp_path / "a.py", "locus.b": tmp_path / "b.py"}
    graph = {name: imports_of(path, name, known) for name, path in known.items()}
    assert graph == {"locus.a": {"locus.b"}, "locus.b": {"locus.a"}}
    assert find_cycle(graph) == ["locus.a", "locus.b", "locus.a"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle_in_locus():
    known = modules()
    graph = {name: imports_of(path, name, known) for name, path in known.items()}
    cycles = []
    seen: set[frozenset] = set()
    while (cycle := find_cycle(graph)) is not None:
        key = frozenset(cycle)
        if key not in seen:
            seen.add(key)
            cycles.append(" -> ".join(cycle))
        graph[cycle[-2]].discard(cycle[-1])  # drop one edge of it and look for more, to list them all
    assert not cycles, "import cycles inside locus/:\n" + "\n".join(cycles)
