"""Suite-wide set-up; keep this file minimal.

Without a GPU, Triton kernels run in Triton's interpreter. TRITON_INTERPRET is read when Triton itself
and each @triton.jit kernel is imported, and test modules import Triton indirectly (transformers does),
so it is set here, in the first conftest pytest loads, before any test module.
"""

import inspect
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Slow tests that start processes (servers, rank groups, bench scripts, the CLI) are timing-sensitive
# where they share 2 cores. The other slow tests compute in the test process alone (Triton's interpreter,
# transformers' parity runs, compiled graphs). A slow test is `processes` if its file lives where every
# test starts processes, or names a way to start one; anything unsure counts as `processes`.
PROCESS_DIRS = ("tests/server/", "tests/bench/", "tests/router/", "tests/engine/ep/")
PROCESS_WORDS = ("subprocess", "Popen", "running_server", "multiprocessing", "rank_cases", "torchrun",
                 "bench_scripts", "spawn")

# A `processes` test is also `serial` (make test runs these one at a time) unless it starts one process
# at a time that holds one model: a single-process `locus serve`, a CLI command or a bench script that
# starts no ranks. Rank groups and router fleets hold a model and a KV pool per process (two at once
# exhaust memory) and wait on each other in collectives with timeouts; network namespaces and `tc` are
# machine-wide. So a test shares the cores only if its file is listed below (each checked by hand for
# what its tests and fixtures launch) and neither its own source nor any fixture it uses names a rank
# launch: a new file, or a new rank test in a listed one, runs alone until someone decides otherwise.
ONE_PROCESS_FILES = frozenset(f"tests/{name}.py" for name in (
    "server/test_api_details", "server/test_compiled_serving", "server/test_flag_validation",
    "server/test_fuzz_requests", "server/test_fuzz_scoring", "server/test_openai_api", "server/test_openapi",
    "server/test_plan_serving", "server/test_quantized_serving", "server/test_reliability",
    "server/test_reliability_limits", "server/test_request_limits", "server/test_startup_shutdown",
    "server/test_structured_outputs", "server/test_trace_endpoints",
    "bench/test_bench_astra", "bench/test_bench_gpu_suite", "bench/test_bench_group_alignment",
    "bench/test_bench_kernels", "bench/test_bench_locality_bound", "bench/test_bench_mini_trace",
    "bench/test_bench_offline",
    "bench/test_bench_quantized", "bench/test_bench_serve", "bench/test_bench_soak",
    "bench/test_bench_stop_strings",
    "engine/test_engine_cli", "engine/checkpoint/test_quantize_experts", "routing/replay/test_replay_epochs",
    "traces/test_trace_synth", "test_readme_quickstart", "router/test_route_imports"))
RANK_WORDS = ("ep-ranks", "ep_ranks", "gpus-per-node", "torchrun", "init_process_group", "spawn", "rank_cases",
              "netns", "\"tc\"")
_starts_processes: dict[str, bool] = {}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "processes: a slow test that starts processes (set by tests/conftest.py "
                                       "for slow tests)")
    config.addinivalue_line("markers", "serial: a processes test that may start several model processes, "
                                       "network namespaces or tc (set by tests/conftest.py; make test runs "
                                       "these one at a time)")


def relative_path(path) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.relpath(str(path), root).replace(os.sep, "/")


def starts_processes(path) -> bool:
    key = str(path)
    if key not in _starts_processes:
        in_dir = relative_path(key).startswith(PROCESS_DIRS)
        with open(key, encoding="utf-8") as f:
            text = f.read()
        _starts_processes[key] = in_dir or any(word in text for word in PROCESS_WORDS)
    return _starts_processes[key]


def source_of(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def names_a_rank_launch(item) -> bool:
    """Whether the test's own source or that of any fixture it uses (directly or through others) names a
    way to start ranks; a test whose source cannot be read counts as naming one."""
    function = getattr(item, "function", None)
    info = getattr(item, "_fixtureinfo", None)
    if function is None or info is None:
        return True
    sources = [source_of(function)]
    if not sources[0]:
        return True
    for definitions in info.name2fixturedefs.values():
        sources.extend(source_of(d.func) for d in definitions)
    return any(word in text for text in sources for word in RANK_WORDS)


def runs_alone(item) -> bool:
    return relative_path(item.path) not in ONE_PROCESS_FILES or names_a_rank_launch(item)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("slow") is not None and starts_processes(item.path):
            item.add_marker("processes")
            if runs_alone(item):
                item.add_marker("serial")
