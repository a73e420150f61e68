"""The server reads the engine through one interface (issue 58, item 3): `AsyncEngine`'s snapshots and
requests (locus/engine/frontend/health.py, locus/engine/ep/ranks/health.py), never the engine's parts
(its core, backend, rank 0's driver and worker, the recorder, the re-planner). Checked on the source
with an AST walk over locus/server, so that a new endpoint reaching into the engine fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import locus.server

SERVER = Path(locus.server.__file__).parent

# What the server may ask of an AsyncEngine (locus/engine/frontend/async_engine.py)
INTERFACE = {
    "info", "stats", "health", "recording", "expert_load", "ep_ranks", "ep_stats", "admission_log",  # reads
    "healthy", "failed",  # reads, kept as properties
    "validate", "admit", "check_admission",  # a request
    "start_recording", "stop_recording", "recording_between_steps", "dump_recording", "request_replan",
    "start", "stop_admitting", "fail_all", "shutdown", "on_finished",  # its lifecycle, and the finished hook
}
# The engine's parts, by the names they go by in the engine: an attribute of that name is a reach past the interface
PARTS = {"core", "backend", "driver", "ep_driver", "worker", "roster", "records", "members", "runtime", "replanner",
         "admissions", "recorder"}
# The modules of rank 0's engine parts (a rank other than 0 is started from cli.py with its worker: no HTTP, no reading)
PART_MODULES = ("locus.engine.core.backend", "locus.engine.ep.ranks.driver", "locus.engine.ep.ranks.stats")
PART_ROOTS = {"core", "driver", "ep_driver"}  # a part in hand: what `engine.call(fn)` handed fn, say
HOLDERS = {"state", "locus_state", "self"}  # what holds the server's engine (`state.engine`, `self.engine`)


def chain(node: ast.Attribute) -> list[str]:
    """`a.b().c[0].d` -> ["a", "b", "c", "d"]: the names from the root, through calls and subscripts."""
    names = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            break
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def violations_in(source: str, where: str) -> list[str]:
    """Each import of a part's module, and each attribute chain (the whole chain, once) that reads a part or
    asks the server's engine for something outside INTERFACE."""
    tree = ast.parse(source)
    inner = set()  # attributes inside a longer chain: the chain is reported once
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            below = node.value
            while isinstance(below, (ast.Call, ast.Subscript)):
                below = below.func if isinstance(below, ast.Call) else below.value
            inner.add(id(below))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{where}:{node.lineno} imports {m}" for m in modules if m.startswith(PART_MODULES)]
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        names = chain(node)
        parts = [name for name in names[1:] if name in PARTS] + [names[0]] * (names[0] in PART_ROOTS)
        outside = [names[i + 1] for i, name in enumerate(names[:-1])
                   if name == "engine" and (i == 0 or names[i - 1] in HOLDERS) and names[i + 1] not in INTERFACE]
        if parts or outside:
            found.append(f"{where}:{node.lineno} reads {'.'.join(names)}")
    return found


def server_violations() -> list[str]:
    found = []
    for path in sorted(SERVER.rglob("*.py")):
        found += violations_in(path.read_text(), str(path.relative_to(SERVER.parent.parent)))
    return sorted(set(found))


def test_the_server_reads_the_engine_only_through_its_interface():
    assert server_violations() == []


def test_the_check_finds_each_way_past_the_interface():
    """Every form the server used before the interface (issue 58 counted them) is caught."""
    reaching = {
        "engine.core.tokenizer": "tok = engine.core.tokenizer",
        "state.engine.core.recorder": "if state.engine.core.recorder is not None: pass",
        "the driver's worker": "lost = set(driver.worker.members)",
        "the server's driver": "driver = state.ep_driver",
        "the backend's load": "load = self.engine.backend.expert_load",
        "a call on the core": "engine.call(lambda core: core.dump_recording())",
        "the driver's import": "from locus.engine.ep.ranks.driver import EPDriver",
        "the driver's records": "records = self.ep_driver.records",
    }
    for what, line in reaching.items():
        assert violations_in(line, "x.py"), what
    allowed = ["tok = engine.info.tokenizer", "if state.engine.health().ep is not None: pass",
               "engine = built.serve(max_waiting=1)", "config.engine.grammar_limits", "need.ranks * need.per_rank"]
    for line in allowed:
        assert violations_in(line, "x.py") == [], line
