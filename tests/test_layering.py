"""The layering rule of docs/design.md ("Layout and layering"), checked on the source: a lower layer never imports a higher one."""

from __future__ import annotations

import ast
from pathlib import Path

import locus

ROOT = Path(locus.__file__).parent
# package -> the locus packages it may import (besides the leaf modules at the package root:
# errors.py and files.py, which import nothing of ours, for every layer above kernels and traces)
ALLOWED = {
    "kernels": set(),
    "traces": set(),
    "routing": {"kernels", "traces"},
    "engine": {"routing", "kernels", "traces"},
    "training": {"engine", "routing", "kernels", "traces"},
    "server": {"engine", "routing", "kernels", "traces"},
}


def imported_locus_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "locus" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_no_layer_imports_a_higher_one():
    violations = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            own = {package}
            extra = {"errors", "files"} if package not in ("kernels", "traces") else set()
            bad = imported_locus_packages(path) - allowed - own - extra
            if bad:
                violations.append(f"{path.relative_to(ROOT.parent)} imports {sorted(bad)}")
    assert not violations, "\n".join(violations)


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
