"""The CPU routed-expert kernel (locus/kernels/moe_cpu.c) against fused_moe_reference.

Cases cover what the C code branches on: rows per expert below, at and above its row block (8), column
counts that are not a multiple of the vector width (16) and hidden sizes that are not a multiple of
its weight-row block (8), weights that are strided views (a rank's slice), pairs held elsewhere
(expert_map), the weight on the input and on the output, float32 and bfloat16. The build itself is
checked too: one library per machine, reused, and a clear fallback when no compiler works.
"""

from __future__ import annotations

import logging

import pytest
import torch
from moe_problems import assert_close, half_expert_map, make_experts, make_routing

from locus.kernels import fused_moe, moe_cpu
from locus.kernels.moe_reference import fused_moe_reference

pytestmark = pytest.mark.skipif(not moe_cpu.available(), reason="no C compiler: the cpu backend is unavailable")

CASES = [  # T, K, E, H, I, routing kind
    (1, 1, 16, 256, 512, "random"),
    (32, 1, 16, 256, 512, "random"),  # the `small` preset's decode step
    (7, 2, 4, 32, 64, "random"),
    (13, 2, 4, 36, 40, "random"),  # H % 8 = 4 (leftover weight rows), I % 16 = 8 (leftover columns)
    (5, 3, 8, 21, 19, "random"),  # every dimension odd
    (20, 1, 16, 64, 600, "one_expert"),  # 20 rows on one expert: three row blocks; I over the 512-column block
    (64, 8, 16, 40, 72, "random"),
    (30, 2, 16, 32, 64, "even_only"),  # idle experts
]


def run(T, K, E, H, I, kind, dtype, weight_on_input, with_map=False, strided=False):
    ids, weights = make_routing(T, K, E, kind, seed=T + E)
    x, gate_up, down = make_experts(T, E, H, I, dtype, seed=H)
    expert_map = None
    if with_map:
        expert_map = half_expert_map(E)
        gate_up, down = gate_up[::2], down[::2]  # strided views over the whole [E, ...] tensors
        if not strided:
            gate_up, down = gate_up.contiguous(), down.contiguous()
    expected = fused_moe_reference(x, gate_up, down, ids, weights, weight_on_input, expert_map)
    actual = moe_cpu.fused_moe_cpu(x, gate_up, down, ids, weights, weight_on_input, expert_map)
    return actual, expected


@pytest.fixture
def kernel_only(monkeypatch):
    """Fail if fused_moe_cpu falls back to the reference, and let the kernel take any row count."""
    def refuse(*args, **kwargs):
        raise AssertionError("fused_moe_cpu fell back to the reference")

    monkeypatch.setattr(moe_cpu, "fused_moe_reference", refuse)
    monkeypatch.setattr(moe_cpu, "CPU_MAX_ROWS", {dtype: 10**9 for dtype in moe_cpu.CPU_MAX_ROWS})


@pytest.fixture(params=[1, 2, 3], ids=lambda t: f"{t}threads")
def threads(request):
    """The kernel splits its work over torch.get_num_threads() OpenMP threads: one, two and an odd
    count, whatever the run's default (make test's fast tests run with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("T, K, E, H, I, kind", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weight_on_input", [True, False], ids=["w_in", "w_out"])
def test_matches_reference(kernel_only, T, K, E, H, I, kind, dtype, weight_on_input, threads):
    actual, expected = run(T, K, E, H, I, kind, dtype, weight_on_input)
    if dtype == torch.float32:  # float32 accumulation on both sides: only the summation order differs
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:  # the reference rounds g, u and silu(g)*u to bfloat16, the kernel keeps them in float32
        assert_close(actual, expected)


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rank_holding_half_the_experts(kernel_only, strided, dtype, threads):
    actual, expected = run(40, 2, 16, 48, 80, "random", dtype, True, with_map=True, strided=strided)
    assert_close(actual, expected)


def test_nothing_held_here_gives_zeros(kernel_only):
    x, gate_up, down = make_experts(6, 4, 32, 64, torch.float32)
    ids = torch.tensor([[1], [3], [1], [3], [1], [3]])
    out = moe_cpu.fused_moe_cpu(x, gate_up[:2], down[:2], ids, torch.ones(6, 1), True,
                                torch.tensor([0, -1, 1, -1], dtype=torch.int32))
    assert out.shape == (6, 32) and not out.any()


def test_expert_ids_out_of_range_are_named(kernel_only):
    x, gate_up, down = make_experts(3, 4, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="outside 4 experts"):
        moe_cpu.fused_moe_cpu(x, gate_up, down, torch.tensor([[0], [4], [1]]), torch.ones(3, 1))
    with pytest.raises(ValueError, match="outside the expert map's 4 entries"):
        moe_cpu.fused_moe_cpu(x, gate_up[:2], down[:2], torch.tensor([[0], [7], [1]]), torch.ones(3, 1), True,
                              torch.tensor([0, -1, 1, -1]))


def test_large_batches_and_other_dtypes_use_the_reference(monkeypatch):
    calls = []
    real = moe_cpu.fused_moe_reference
    monkeypatch.setattr(moe_cpu, "fused_moe_reference", lambda *a: calls.append(a[0].dtype) or real(*a))
    T = max(moe_cpu.CPU_MAX_ROWS.values()) + 1
    ids, weights = make_routing(T, 1, 2, "one_expert")  # T rows on one expert: over every limit
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x, gate_up, down = make_experts(T, 2, 32, 64, dtype)
        assert_close(moe_cpu.fused_moe_cpu(x, gate_up, down, ids, weights),
                     fused_moe_reference(x, gate_up, down, ids, weights))
    ids, weights = make_routing(4, 1, 2)
    x, gate_up, down = make_experts(4, 2, 32, 64, torch.float16)  # few rows, but no float16 kernel
    moe_cpu.fused_moe_cpu(x, gate_up, down, ids, weights)
    assert calls == [torch.float32, torch.bfloat16, torch.float16, torch.float16]


@pytest.mark.slow  # compiles a graph (torch.compile)
def test_public_entry_point_and_compiled_graph_use_it():
    """`fused_moe(backend="auto")` on CPU is this kernel, eagerly and inside a compiled graph (the
    custom op `locus::fused_moe`)."""
    ids, weights = make_routing(9, 2, 8, seed=3)
    x, gate_up, down = make_experts(9, 8, 32, 48, torch.float32, seed=3)
    expected = moe_cpu.fused_moe_cpu(x, gate_up, down, ids, weights)
    torch.testing.assert_close(fused_moe(x, gate_up, down, ids, weights, backend="auto"), expected, atol=0, rtol=0)
    compiled = torch.compile(lambda *a: fused_moe(*a, backend="cpu") * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x, gate_up, down, ids, weights), 2 * expected, atol=0, rtol=0)


def test_library_is_built_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCUS_KERNEL_CACHE", str(tmp_path))
    moe_cpu.load_library.cache_clear()
    try:
        assert moe_cpu.load_library() is not None
        built = list(tmp_path.glob("moe_cpu-*.so"))
        assert len(built) == 1 and list(tmp_path.iterdir()) == built  # no temporary file left
        stamp = built[0].stat().st_mtime_ns
        moe_cpu.load_library.cache_clear()
        assert moe_cpu.load_library() is not None
        assert list(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == stamp  # reused
    finally:
        moe_cpu.load_library.cache_clear()


def test_a_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo broken-cc 1.0 && exit 0\necho 'cc: error: no luck' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("LOCUS_KERNEL_CACHE", str(tmp_path / "cache"))
    moe_cpu.load_library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="locus.kernels"):
            assert moe_cpu.load_library() is None
        assert "building the cpu MoE kernel failed" in caplog.text and "no luck" in caplog.text
        assert not list((tmp_path / "cache").glob("*"))  # no half-written library left behind
        from locus.kernels import resolve_backend

        assert resolve_backend("auto", torch.device("cpu")) == "torch"
        ids, weights = make_routing(5, 2, 4)
        x, gate_up, down = make_experts(5, 4, 32, 64, torch.float32)
        torch.testing.assert_close(moe_cpu.fused_moe_cpu(x, gate_up, down, ids, weights),
                                   fused_moe_reference(x, gate_up, down, ids, weights))
    finally:
        moe_cpu.load_library.cache_clear()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_no_tokens(backend):
    """A rank that receives no tokens in an exchange still calls the experts (empty batch, K > 1)."""
    x, gate_up, down = make_experts(0, 4, 32, 64, torch.float32)
    out = fused_moe(x, gate_up, down, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), backend=backend)
    assert out.shape == (0, 32)
