"""The greedy-token sweep (locus/kernels/argmax_cpu.c) against torch.argmax over the vocabulary.

Cases cover what the C code branches on: sequence counts below, at and past a vector (16) and past
its 256-column group, vocabularies smaller than the thread count, ties and NaNs on both sides of the
threads' split of the vocabulary (the merge), a row stride wider than the row, and the fallbacks.
"""

from __future__ import annotations

import pytest
import torch

from locus.kernels import argmax_cpu
from locus.kernels.argmax_cpu import vocab_argmax

pytestmark = pytest.mark.skipif(argmax_cpu.load_library() is None, reason="no C compiler: the kernel is unavailable")


@pytest.fixture(params=[1, 2, 3], ids=lambda t: f"{t}threads")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,B", [(1, 1), (2, 5), (5, 16), (1000, 1), (1000, 17), (3000, 32), (777, 40), (300, 300)])
def test_matches_torch_argmax(V, B, dtype, threads):
    torch.manual_seed(V * 7 + B)
    logits = torch.randn(V, B).to(dtype)
    assert argmax_cpu.kernel_applies(logits)
    assert torch.equal(vocab_argmax(logits), logits.argmax(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_nans_and_infinities_as_torch(dtype, threads):
    """The first index of the maximum; the first NaN above any number; per column, across the split."""
    V, B = 1000, 20
    logits = torch.randn(V, B).to(dtype)
    logits[100, 0] = logits[900, 0] = 50.0  # tie across halves: 100
    logits[900, 1] = float("nan")  # a NaN in the second half beats the first half's max
    logits[100, 2] = logits[900, 2] = float("nan")  # two NaNs: the first
    logits[:, 3] = float("-inf")  # all -inf: index 0
    logits[:, 4] = 1.0  # all equal: index 0
    logits[999, 5] = float("inf")
    logits[0, 17] = float("nan")  # a NaN in a leftover column (20 = 16 + 4)
    logits[500, 18] = logits[600, 18] = 9.0
    expected = logits.argmax(0)
    assert expected[:6].tolist() == [100, 900, 100, 0, 0, 999] and expected[17] == 0 and expected[18] == 500
    assert torch.equal(vocab_argmax(logits), expected)


def test_rows_wider_than_the_batch():
    """A [V, B] view into wider rows (the stride between vocabulary rows is not B)."""
    wide = torch.randn(500, 48)
    view = wide[:, 5:37]
    assert view.stride() == (48, 1) and argmax_cpu.kernel_applies(view)
    assert torch.equal(vocab_argmax(view), view.argmax(0))


def test_fallbacks_are_torch_argmax():
    logits = torch.randn(64, 300)
    for case in (logits.T, logits.to(torch.float16), logits.to(torch.float64)):  # strided columns, other dtypes
        assert not argmax_cpu.kernel_applies(case)
        assert torch.equal(vocab_argmax(case), case.argmax(0))
    empty = torch.empty(0, 4)
    assert not argmax_cpu.kernel_applies(empty)
    with pytest.raises((RuntimeError, IndexError)):  # torch's own error for an empty reduction
        vocab_argmax(empty)


@pytest.mark.slow  # compiles a graph (torch.compile)
def test_inside_a_compiled_graph():
    """As in the compiled decode step: the op takes the [V, B] product of a matmul."""
    w, h = torch.randn(2000, 64), torch.randn(8, 64)
    compiled = torch.compile(lambda w, h: vocab_argmax(w @ h.T), fullgraph=True)
    assert torch.equal(compiled(w, h), (w @ h.T).argmax(0))
