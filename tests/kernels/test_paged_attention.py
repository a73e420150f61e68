"""Paged decode attention (kernels/paged_attention.py): the Triton kernel (interpreted on CPU) against
its torch reference, and the reference against plain causal attention over a contiguous sequence.

Cases that matter for Llama-4: GQA groups that do not fill a 16-row tile (Scout's 5), chunked
attention with queries right after a chunk boundary, padding rows (context 0), tables wider than
any context (a captured graph's), int32 and int64 tables, and splits of the key range merged again."""

from __future__ import annotations

import pytest
import torch

from locus.kernels.paged_attention import (MAX_SPLITS, choose_splits, paged_decode_attention,
                                           paged_decode_attention_reference)
from moe_problems import DEVICE, requires_gpu

BLOCK = 16


def make_problem(lens: list[int], q_heads: int, kv_heads: int, head_dim: int, dtype=torch.float32,
                 width: int = 12, table_dtype=torch.int32, seed: int = 0):
    """q [B, Hq, D], a pool with shuffled blocks, tables [B, width] (each sequence's blocks in a
    random order of the pool's), context lengths [B]."""
    g = torch.Generator().manual_seed(seed)
    B, blocks = len(lens), len(lens) * width + 1
    k = torch.randn(blocks * BLOCK, kv_heads, head_dim, generator=g)
    v = torch.randn(blocks * BLOCK, kv_heads, head_dim, generator=g)
    q = torch.randn(B, q_heads, head_dim, generator=g)
    tables = torch.randperm(blocks, generator=g)[:B * width].view(B, width)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return (q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), tables.to(DEVICE, table_dtype),
            lens_t.to(DEVICE))


@pytest.mark.parametrize("chunk", [0, 32])
@pytest.mark.parametrize("groups", [(8, 2), (10, 2), (4, 4)])
def test_kernel_equals_reference(chunk, groups):
    q_heads, kv_heads = groups
    q, k, v, tables, lens = make_problem([0, 1, 31, 32, 33, 100, 191], q_heads, kv_heads, 16)
    out = paged_decode_attention(q, k, v, tables, lens, BLOCK, chunk, 0.25)
    ref = paged_decode_attention_reference(q, k, v, tables, lens, BLOCK, chunk, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # a padding row (context 0) reads nothing


@pytest.mark.parametrize("splits", [2, 4])
def test_splits_merge_to_the_unsplit_result(splits):
    """Short contexts forced into several splits (min_split lowered), some of them empty."""
    q, k, v, tables, lens = make_problem([0, 5, 40, 150, 192], 8, 2, 32, table_dtype=torch.int64)
    one = paged_decode_attention(q, k, v, tables, lens, BLOCK, 64, 0.2, splits=1)
    many = paged_decode_attention(q, k, v, tables, lens, BLOCK, 64, 0.2, splits=splits, min_split=16)
    torch.testing.assert_close(many, one, atol=1e-5, rtol=0)


def test_reference_is_causal_chunked_attention_over_the_sequence():
    """The reference of one sequence equals softmax attention of its last position over the visible
    positions of its contiguous keys (GQA expanded by hand)."""
    q, k, v, tables, lens = make_problem([70], 4, 2, 16)
    rows = (tables[0].long()[:, None] * BLOCK + torch.arange(BLOCK, device=DEVICE)).flatten()
    keys, values = k[rows][:70], v[rows][:70]  # positions 0..69 in order
    for chunk, first in ((0, 0), (64, 64)):
        scores = torch.einsum("hd,shd->hs", q[0], keys.repeat_interleave(2, dim=1)[first:]) * 0.3
        expected = torch.einsum("hs,shd->hd", scores.softmax(-1), values.repeat_interleave(2, dim=1)[first:])
        got = paged_decode_attention_reference(q, k, v, tables, lens, BLOCK, chunk, 0.3)[0]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_bad_arguments_are_named():
    q, k, v, tables, lens = make_problem([3], 4, 2, 16)
    with pytest.raises(ValueError, match="splits"):
        paged_decode_attention(q, k, v, tables, lens, BLOCK, 0, 1.0, splits=3)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_decode_attention(q[:, :3], k, v, tables, lens, BLOCK, 0, 1.0)
    with pytest.raises(ValueError, match="one row per sequence"):
        paged_decode_attention(q, k, v, tables, lens[:0], BLOCK, 0, 1.0)
    assert choose_splits(1, 8, torch.device("cpu")) == 1


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_gpu_with_scout_heads(dtype):
    """Scout's heads (40 query, 8 kv, D 128), long contexts over a chunk boundary, the GPU's splits."""
    lens = [0, 1, 8191, 8192, 8193, 3000, 9000, 17]
    q, k, v, tables, lens_t = make_problem(lens, 40, 8, 128, dtype=dtype, width=600)
    splits = choose_splits(len(lens), 8, DEVICE)
    assert 1 <= splits <= MAX_SPLITS
    out = paged_decode_attention(q, k, v, tables, lens_t, BLOCK, 8192, 128 ** -0.5, splits=splits)
    ref = paged_decode_attention_reference(q, k, v, tables, lens_t, BLOCK, 8192, 128 ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=0)
