"""Paged decode attention: one query per sequence against its keys and values in a paged KV pool.

A decode graph is captured once per batch-size bucket, so its block tables have a fixed width (the
most blocks a sequence can hold). Gathering that whole width every step would make each step cost
what the longest possible context costs. This kernel reads only what each query sees: its
`context_lens[b]` is the query's position + 1, and the keys visible to it are
    [chunk start, position]  with chunk start = (position // chunk_size) * chunk_size
on Llama-4's chunked-attention (RoPE) layers, and [0, position] on full-attention (NoPE) layers
(`chunk_size` 0). A row with context length 0 (a padding row of the bucket) reads nothing and
returns zeros.

Algorithm (FlashAttention's online softmax, vLLM's paged attention v2 split):
    program (b, kv head h, split s) owns the GROUP = Hq / Hkv query heads of h (GQA: each key tile is
    loaded once for all of them) and one contiguous part of the visible range; it walks that part in
    BLOCK_N-position tiles, looking up each position's block in the table, and keeps a running max m,
    a running sum l and an fp32 accumulator. With one split it writes acc / l; with several, each
    writes (m, l, acc) and a second kernel merges the splits. Splits exist for few sequences with long
    contexts (too few programs to fill the GPU otherwise); a range shorter than MIN_SPLIT_LEN stays
    in the first split, so short contexts pay only the merge kernel's launch.
The number of splits is fixed per call (a graph's grid is static); the part each split takes
follows the context length at run time.

Shape legend: B sequences, Hq query heads, Hkv kv heads, D head dim, R pool rows, W table width,
S splits.
    q            [B, Hq, D]
    k/v cache    [R, Hkv, D]   row = block * block_size + position % block_size
    block_tables [B, W]        int32 / int64 block ids
    context_lens [B]           int: visible positions end at context_lens[b] - 1
    out          [B, Hq, D]    q's dtype
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_SPLIT_LEN = 256  # positions a split takes at least (below it, splitting only costs)
MAX_SPLITS = 16


@triton.jit
def _attend_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, stats_ptr,
    scale, chunk_size, block_size,
    stride_qb, stride_qh, stride_kr, stride_kh, stride_tb, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, MIN_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    chunk = tl.maximum(chunk_size, 1)
    start = tl.where(chunk_size > 0, (tl.maximum(ctx - 1, 0) // chunk) * chunk, 0)
    per_split = tl.maximum(tl.cdiv(ctx - start, SPLITS), MIN_SPLIT)
    lo = start + s * per_split
    hi = tl.minimum(lo + per_split, ctx)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    heads = h * GROUP + g
    g_ok = g < GROUP
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = tables_ptr + b.to(tl.int64) * stride_tb
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < hi
        block = tl.load(table + pos // block_size, mask=ok, other=0).to(tl.int64)
        rows = block * block_size + pos % block_size
        offs = rows[:, None] * stride_kr + h * stride_kh + d[None, :]
        k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    if SPLITS == 1:
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        out = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # part [B, Hq, S, D] and stats [B, Hq, S, 2] (m, l), contiguous
        row = (b * GROUP * tl.num_programs(1) + heads) * SPLITS + s  # [GROUP_PAD]
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None])
        tl.store(stats_ptr + row * 2, m, mask=g_ok)
        tl.store(stats_ptr + row * 2 + 1, l, mask=g_ok)


@triton.jit
def _merge_kernel(part_ptr, stats_ptr, out_ptr, stride_ob, stride_oh,
                  HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    row = (b * HEADS + hq) * SPLITS + s
    m = tl.load(stats_ptr + row * 2)
    l = tl.load(stats_ptr + row * 2 + 1)
    top = tl.max(m, axis=0)
    w = tl.exp(m - tl.where(top > float("-inf"), top, 0.0))  # empty splits (m = -inf) weigh 0
    acc = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :])
    total = tl.sum(w * l, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + hq * stride_oh + d, o.to(out_ptr.dtype.element_ty))


def choose_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Splits that fill the device when batch * kv_heads programs would not (1 on CPU)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = batch * kv_heads
    if programs >= sms:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(sms, programs)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           chunk_size: int, scale: float, splits: int = 1,
                           min_split: int = MIN_SPLIT_LEN) -> torch.Tensor:
    """[B, Hq, D] attention output of each sequence's one query (Triton; see the module docstring).
    chunk_size 0 = full causal attention; splits: a power of two, at most MAX_SPLITS; min_split:
    the fewest positions a split takes (tests lower it to split short contexts)."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != D or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)} and k/v caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                         "must share the head dim, with query heads a multiple of kv heads")
    if block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must have one row per sequence ({B})")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head dim {D} must be a power of two >= 16")
    if splits < 1 or splits > MAX_SPLITS or splits & (splits - 1):
        raise ValueError(f"splits must be a power of two in 1..{MAX_SPLITS}, got {splits}")
    if k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride() or block_tables.stride(1) != 1:
        raise ValueError("the caches and the block tables need a unit last stride (and the caches one layout)")
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    group = Hq // Hkv
    if splits > 1:
        part = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=q.device)
        stats = torch.empty(B, Hq, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = stats = out  # never touched
    _attend_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part, stats,
        scale, chunk_size, block_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, BLOCK_N=_block_n(D),
        SPLITS=splits, MIN_SPLIT=min_split, DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    if splits > 1:
        _merge_kernel[(B, Hq)](part, stats, out, out.stride(0), out.stride(1), HEADS=Hq, HEAD_DIM=D, SPLITS=splits)
    return out


def _block_n(head_dim: int) -> int:
    return 64 if head_dim <= 128 else 32  # keeps a K and a V tile in registers at D = 256


def paged_decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                                     chunk_size: int, scale: float) -> torch.Tensor:
    """The same in torch, one sequence at a time (reads context lengths on the host)."""
    B, Hq, D = q.shape
    group = Hq // k_cache.shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        ctx = int(context_lens[b])
        if ctx == 0:
            continue
        start = (ctx - 1) // chunk_size * chunk_size if chunk_size > 0 else 0
        pos = torch.arange(start, ctx, device=q.device)
        rows = block_tables[b].long()[pos // block_size] * block_size + pos % block_size
        k = k_cache[rows].float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v_cache[rows].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[b].float(), k) * scale
        out[b] = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out


@torch.library.custom_op("locus::paged_decode_attention", mutates_args=())
def paged_decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                              chunk_size: int, scale: float, splits: int) -> torch.Tensor:
    """`paged_decode_attention` as one opaque node of a torch.compile'd graph (inductor would
    otherwise try to trace the Triton launch)."""
    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, chunk_size, scale,
                                  splits)


@paged_decode_attention_op.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, block_size, chunk_size, scale, splits) -> torch.Tensor:
    return q.new_empty(q.shape)
