"""The layering rule of docs/design.md ("Layout and layering"), checked on the source: a lower layer never imports a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import locus

ROOT = Path(locus.__file__).parent
# package -> the locus packages it may import (besides the leaf modules at the package root:
# errors.py, files.py, chat_template.py, flags.py and listen.py, which import nothing of ours but
# errors.py, for every layer above kernels and traces)
ALLOWED = {
    "kernels": set(),
    "traces": set(),
    "routing": {"kernels", "traces"},
    "engine": {"routing", "kernels", "traces"},
    "training": {"engine", "routing", "kernels", "traces"},
    "server": {"engine", "routing", "kernels", "traces"},
    # the router talks to engines over HTTP only: the grouper (routing/) chooses, no engine is imported
    "router": {"routing", "kernels", "traces"},
}
LEAVES = {"errors", "files", "chat_template", "flags", "listen"}


def imported_names(path: Path) -> set[str]:
    """What `path` imports by absolute name, at any depth of the file: `import a.b` gives a.b,
    `from a.b import c` gives a.b and a.b.c (c may be a module: `from locus.engine.core import sequence`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def imported_locus_packages(path: Path) -> set[str]:
    return {name.split(".")[1] for name in imported_names(path) if name.startswith("locus.")}


def test_no_layer_imports_a_higher_one():
    violations = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            own = {package}
            extra = LEAVES if package not in ("kernels", "traces") else set()
            bad = imported_locus_packages(path) - allowed - own - extra
            if bad:
                violations.append(f"{path.relative_to(ROOT.parent)} imports {sorted(bad)}")
    assert not violations, "\n".join(violations)


def test_the_leaf_modules_import_nothing_of_ours_but_errors():
    for leaf in sorted(LEAVES):
        assert imported_locus_packages(ROOT / f"{leaf}.py") <= {"errors"}, f"locus/{leaf}.py imports a package"


def files_importing(folder: Path, module: str) -> list[str]:
    """The files under `folder` that import `module` or anything inside it (at any depth of the file)."""
    offenders = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(name == module or name.startswith(module + ".") for name in names):
                offenders.append(str(path.relative_to(ROOT.parent)))
                break
    return offenders


def test_routing_holds_no_process_group_code():
    """routing/ decides and costs where tokens go; moving them (torch.distributed) is the engine's
    expert-parallel runtime (locus/engine/ep/)."""
    offenders = files_importing(ROOT / "routing", "torch.distributed")
    assert not offenders, f"process-group code under routing/: {offenders}"


def test_checkpoint_does_not_import_expert_parallelism():
    """The loader sits below expert parallelism: checkpoint/ builds a model (whole, or holding one rank's
    expert slices, engine/model/slices.py) without knowing about ranks; engine/ep/ builds on it."""
    offenders = files_importing(ROOT / "engine" / "checkpoint", "locus.engine.ep")
    assert not offenders, f"checkpoint/ imports engine/ep: {offenders}"


ENGINE = ROOT / "engine"
# engine part -> the other engine parts it may import (a part: a sub-package of engine/ or a module at its root)
BELOW_THE_LOOP = {"model": {"host_transfer"}, "checkpoint": {"model", "host_transfer"}}


def engine_parts_imported(path: Path) -> set[str]:
    """The parts of the engine that `path` imports, at any depth of the file."""
    return {name.split(".")[2] for name in imported_names(path) if name.startswith("locus.engine.")}


def test_the_model_sits_below_the_engine_loop():
    """engine/model/ (the Llama-4 modules, KV caches) and engine/checkpoint/ (loading them) know nothing of
    the loop that runs them: core/, sampling/, requests/, runner/, policies/, observers/, frontend/ and
    ep/ build on the model, never the other way round."""
    violations = []
    for part, allowed in BELOW_THE_LOOP.items():
        for path in sorted((ENGINE / part).rglob("*.py")):
            bad = engine_parts_imported(path) - allowed - {part}
            if bad:
                violations.append(f"{path.relative_to(ROOT.parent)} imports engine/{sorted(bad)}")
    assert not violations, "\n".join(violations)


def test_only_the_cli_imports_the_front_ends():
    """engine/frontend/ (build_engine, LLM, AsyncEngine) is the engine's top: inside the engine only the
    `locus generate` CLI uses it; the server and the benches use it from outside."""
    offenders = [f for f in files_importing(ENGINE, "locus.engine.frontend")
                 if not f.startswith("locus/engine/frontend/") and f != "locus/engine/cli.py"]
    assert not offenders, f"engine modules importing engine/frontend/: {offenders}"


# Inside a package, its parts stack one way too: a part (a sub-package, or a module at the package's root)
# imports only parts declared lower, at any depth of the file (an import inside a function or under
# `if TYPE_CHECKING:` is still a dependency: the lower part cannot be understood, moved or tested without
# the higher one). Lowest first; "*.py" stands for every module at the package's root, one level that may
# import itself. docs/design.md ("Layout and layering") writes the same orders.
PART_ORDERS = {
    "engine": ["host_transfer", "model", "checkpoint", "sampling", "requests", "runner", "observers", "policies",
               "core", "ep", "frontend", "cli"],
    "routing": ["gate", "node_cover", "plan", "expert_groups", "dispatch_rule", "replay", "grouping", "planners", "cli"],
    "engine/ep": ["*.py", "rebalance", "ranks"],
}


def package_parts(package: Path) -> set[str]:
    """The parts of `package`: its sub-packages and the modules at its root (not __init__.py)."""
    subs = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return subs | {p.stem for p in package.glob("*.py") if p.stem != "__init__"}


def part_levels(package: str) -> dict[str, int]:
    """Each part of `package` -> its level in PART_ORDERS (the root's modules share the level of "*.py")."""
    levels = {}
    for level, part in enumerate(PART_ORDERS[package]):
        if part == "*.py":
            levels.update({p.stem: level for p in (ROOT / package).glob("*.py") if p.stem != "__init__"})
        else:
            levels[part] = level
    return levels


def part_of(name: str, package: str) -> str | None:
    """The part of `package` that module `name` lies in, or None when it lies outside (or is the package)."""
    prefix = "locus." + package.replace("/", ".") + "."
    return name[len(prefix):].split(".")[0] if name.startswith(prefix) else None


def upward_imports(package: str) -> list[str]:
    """Every import, in a module of `package`, of a part of `package` declared higher than the module's own."""
    levels = part_levels(package)
    violations = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.parent == ROOT / package and path.stem == "__init__":
            continue
        own = path.relative_to(ROOT / package).parts[0].removesuffix(".py")
        if own not in levels:  # a part the order does not name: test_the_order_names_every_part says so
            continue
        above = sorted({part for name in imported_names(path)
                        if (part := part_of(name, package)) in levels and levels[part] > levels[own]})
        if above:
            violations.append(f"{path.relative_to(ROOT.parent)} ({own}) imports {above}")
    return violations


@pytest.mark.parametrize("package", sorted(PART_ORDERS))
def test_the_order_names_every_part(package):
    """A new sub-package or root module is placed in the order, not silently left out of the check."""
    assert package_parts(ROOT / package) == set(part_levels(package)), \
        f"locus/{package}: parts {sorted(package_parts(ROOT / package) ^ set(part_levels(package)))} " \
        "are not in PART_ORDERS, or no longer exist"


@pytest.mark.parametrize("package", sorted(PART_ORDERS))
def test_no_part_imports_a_higher_one(package):
    violations = upward_imports(package)
    assert not violations, f"locus/{package}, order {' < '.join(PART_ORDERS[package])}:\n" + "\n".join(violations)


def test_an_import_inside_a_function_counts(tmp_path):
    source = tmp_path / "late.py"
    source.write_text("def f():\n    from locus.engine.core import engine_core\n    return engine_core\n")
    assert part_of("locus.engine.core.engine_core", "engine") == "core"
    assert "locus.engine.core.engine_core" in imported_names(source)
