"""Suite-wide set-up; keep this file minimal.

Without a GPU, Triton kernels run in Triton's interpreter. TRITON_INTERPRET is read when Triton itself
and each @triton.jit kernel is imported, and test modules import Triton indirectly (transformers does),
so it is set here, in the first conftest pytest loads, before any test module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Slow tests that start processes (servers, rank groups, bench scripts, the CLI) are timing-sensitive
# where they share 2 cores: `make test` runs them one at a time. The other slow tests compute in the
# test process alone (Triton's interpreter, transformers' parity runs, compiled graphs) and are spread
# over two workers. A slow test is `processes` if its file lives where every test starts processes, or
# names a way to start one; anything unsure counts as `processes` (run alone: slower, never flaky).
PROCESS_DIRS = ("tests/server/", "tests/bench/", "tests/router/", "tests/engine/ep/")
PROCESS_WORDS = ("subprocess", "Popen", "running_server", "multiprocessing", "rank_cases", "torchrun",
                 "bench_scripts", "spawn")
_starts_processes: dict[str, bool] = {}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "processes: a slow test that starts processes (set by tests/conftest.py "
                                       "for slow tests; make test runs these one at a time)")


def starts_processes(path) -> bool:
    key = str(path)
    if key not in _starts_processes:
        relative = os.path.relpath(key, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        in_dir = relative.replace(os.sep, "/").startswith(PROCESS_DIRS)
        with open(key, encoding="utf-8") as f:
            text = f.read()
        _starts_processes[key] = in_dir or any(word in text for word in PROCESS_WORDS)
    return _starts_processes[key]


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("slow") is not None and starts_processes(item.path):
            item.add_marker("processes")
