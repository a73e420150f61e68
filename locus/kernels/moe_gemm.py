"""Grouped GEMMs of fused MoE: every BLOCK_M-row block of aligned pairs times its own expert's weights.

After the align step (moe_align.py) the pairs sit expert by expert in BLOCK_M-row blocks. A program
owns one (block, N-tile, K-slice): it reads the block's expert id, gathers the block's A rows by pair
id, and multiplies them by a [slice of H or I, BLOCK_N] piece of that expert's weight. Padding rows
(pair id == P) are masked on load and never stored; blocks past the padded end return at once.
Two kernels:

  gate_up:  h[p] = silu(g) * u,  [g | u] = w[p] * (a[p] @ gate_up[e])  (w[p] when the weight goes on
            the input, a[p] = x[p // K]). Each program keeps a gate and an up accumulator for the same
            N columns, so the SwiGLU epilogue needs no second pass and the [P, 2I] product is never
            written. The routing weight scales the fp32 accumulators (a row scale commutes with the
            product), so the A tile goes from memory to the tensor cores untouched.
  down:     y[p] = h[p] @ down[e], scaled by w[p] when the weight goes on the output.

Split-K (config.split_k = S > 1): a decode batch touches a few experts, so BLOCK_M blocks x N-tiles
alone leave most SMs idle (one Llama-4 expert, down GEMM, BLOCK_N 64: 80 programs on 132 SMs) and
each busy SM has too few loads in flight to stream weights at HBM speed. Splitting the reduction
into S slices gives S times the programs, each streaming 1/S of the weight tile column. Each slice
writes fp32 partial sums to a workspace [S, P, W]; a reduce pass (one program per block and column
tile, reading only the block's real rows) adds the S partials in a fixed order and applies the
epilogue (SwiGLU for gate_up, the routing weight for down), so results are deterministic and do
not depend on S beyond fp32 rounding. No atomics, so the workspace needs no clearing.

Narrow expert weights (fp8, mxfp8, mxfp4 QuantizedTensors, moe_quantized.py) are read as stored:
each K step loads the step's narrow tile (and its scales) and multiplies it in one of the dot forms
of moe_narrow.py (widened in registers then the ordinary dot; tl.dot_scaled; or FP8 tensor cores),
so split-K, the weight on input or output and the expert map work unchanged. The "fp8" form
quantizes each GEMM's activations once per row before its launch (x, then h).

Tiles are visited GROUP_M blocks at a time down M before moving along N (Triton tutorial 03): nearby
blocks usually share an expert, so a weight tile loaded into L2 serves the whole group.
Accumulation is fp32. With fp32 inputs tl.dot runs at "ieee" precision (no TF32) so fp32 results
match the torch reference tightly. Every size these kernels see comes from shapes known on the host
(T, K, E, BLOCK_M); nothing is read back, so a call can be captured in a CUDA graph. The token-count
arguments are not specialised on, so one compiled kernel serves every batch size.

Shape legend: T tokens, K slots, P = T*K pairs, E local experts, H hidden, I expert width, S splits.
    x        [T, H]        gate_up [E, H, 2I]   (gate = first I columns; narrow: scales along H)
    h        [P, I]        down    [E, I, H]    (narrow: scales along I)
    y        [P, H]        topk_weights [T, K] (read flat as [P])
    partials [S, P, 2I] (gate_up) or [S, P, H] (down), fp32
Rows of h and y belong to pairs; rows of pairs that no block computes are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from locus.kernels.formats import QuantizedTensor
from locus.kernels.moe_align import AlignedRouting
from locus.kernels.moe_configs import MoeConfig
from locus.kernels.moe_dot_forms import MIN_BLOCK_K, check_dot, choose_dot
from locus.kernels.moe_narrow import (
    WeightOperand,
    apply_scales,
    dot_fp8_tile,
    dot_scaled_tile,
    fp8_native,
    load_weight_tile,
    quantize_activations,
    weight_operand,
)

REDUCE_TILE = 4096  # elements of one reduce program's [BLOCK_M, columns] tile
_LHS_FORMAT = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # tl.dot_scaled's name for 16-bit activations


@triton.jit
def _tile_coords(num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(block, N-tile) of this program, in groups of GROUP_M blocks for L2 reuse of weight tiles."""
    pid = tl.program_id(0)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _multiply_step(acc, a, w_ptr, s_ptr, k, k_stop, offs_n, n_ok, stride_wk, stride_wn, stride_sk, stride_sn,
                   FORMAT: tl.constexpr, DOT: tl.constexpr, LHS_FORMAT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] @ rows k .. k + BLOCK_K of one expert's weight, in the dot form DOT
    (moe_narrow.py; for "fp8", a is already E4M3 and its row scales come after the loop)."""
    if DOT == "scaled":
        return dot_scaled_tile(acc, a, w_ptr, s_ptr, k, k_stop, offs_n, n_ok, stride_wk, stride_wn, stride_sk,
                               stride_sn, FORMAT, LHS_FORMAT, BLOCK_K)
    elif DOT == "fp8":
        return dot_fp8_tile(acc, a, w_ptr, k, k_stop, offs_n, n_ok, stride_wk, stride_wn, BLOCK_K)
    else:
        w = load_weight_tile(w_ptr, s_ptr, k, k_stop, offs_n, n_ok, stride_wk, stride_wn, stride_sk, stride_sn,
                             FORMAT, BLOCK_K, a.dtype, FP8_NATIVE)
        return tl.dot(a, w, acc, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, weights_ptr, sorted_pair_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, N, H, max_blocks, k_per_split,
    stride_xt, stride_xh, stride_we, stride_wh, stride_wn, stride_se, stride_sh, stride_sn,
    stride_os, stride_op, stride_on,
    TOP_K: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FORMAT: tl.constexpr, DOT: tl.constexpr, LHS_FORMAT: tl.constexpr, FP8_NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """out: h [P, N] (SPLIT_K == 1) or fp32 partials [SPLIT_K, P, 2N], gate then up columns."""
    pid_m, pid_n = _tile_coords(max_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    split = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # int64: expert * stride_we can pass 2^31
    pairs = tl.load(sorted_pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)

    k_begin = split * k_per_split
    k_stop = tl.minimum(H, k_begin + k_per_split)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + (k_begin + offs_k)[None, :] * stride_xh
    g_ptr = w_ptr + expert * stride_we
    u_ptr = g_ptr + N * stride_wn  # up columns sit N = I columns after the gate columns
    gs_ptr = ws_ptr + expert * stride_se
    us_ptr = gs_ptr + N * stride_sn

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(k_stop - k_begin, BLOCK_K)):
        k = k_begin + k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (k + offs_k < k_stop)[None, :], other=0.0)
        acc_g = _multiply_step(acc_g, a, g_ptr, gs_ptr, k, k_stop, offs_n, n_ok, stride_wh, stride_wn, stride_sh,
                               stride_sn, FORMAT, DOT, LHS_FORMAT, DOT_PRECISION, BLOCK_K, FP8_NATIVE)
        acc_u = _multiply_step(acc_u, a, u_ptr, us_ptr, k, k_stop, offs_n, n_ok, stride_wh, stride_wn, stride_sh,
                               stride_sn, FORMAT, DOT, LHS_FORMAT, DOT_PRECISION, BLOCK_K, FP8_NATIVE)
        a_ptrs += BLOCK_K * stride_xh
    acc_g = apply_scales(acc_g, gs_ptr, offs_n, n_ok, stride_sn, xs_ptr, tokens, row_ok, FORMAT, DOT)
    acc_u = apply_scales(acc_u, us_ptr, offs_n, n_ok, stride_sn, xs_ptr, tokens, row_ok, FORMAT, DOT)

    if WEIGHT_ON_INPUT:
        w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
        acc_g = acc_g * w[:, None]
        acc_u = acc_u * w[:, None]
    rows = pairs.to(tl.int64)
    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + rows[:, None] * stride_op + offs_n[None, :] * stride_on
    out_mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        h = acc_g * tl.sigmoid(acc_g) * acc_u  # silu(g) * u, still in fp32
        tl.store(out_ptrs, h.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs, acc_g, mask=out_mask)
        tl.store(out_ptrs + N * stride_on, acc_u, mask=out_mask)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _down_kernel(
    h_ptr, hs_ptr, w_ptr, ws_ptr, out_ptr, weights_ptr, sorted_pair_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, N, I, max_blocks, k_per_split,
    stride_hp, stride_hk, stride_we, stride_wk, stride_wn, stride_se, stride_sk, stride_sn,
    stride_os, stride_op, stride_on,
    WEIGHT_ON_OUTPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FORMAT: tl.constexpr, DOT: tl.constexpr, LHS_FORMAT: tl.constexpr, FP8_NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """out: y [P, N] (SPLIT_K == 1) or fp32 partials [SPLIT_K, P, N] (routing weight not applied yet)."""
    pid_m, pid_n = _tile_coords(max_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    split = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    rows = pairs.to(tl.int64)

    k_begin = split * k_per_split
    k_stop = tl.minimum(I, k_begin + k_per_split)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_hp + (k_begin + offs_k)[None, :] * stride_hk
    b_ptr = w_ptr + expert * stride_we
    bs_ptr = ws_ptr + expert * stride_se

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(k_stop - k_begin, BLOCK_K)):
        k = k_begin + k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (k + offs_k < k_stop)[None, :], other=0.0)
        acc = _multiply_step(acc, a, b_ptr, bs_ptr, k, k_stop, offs_n, n_ok, stride_wk, stride_wn, stride_sk,
                             stride_sn, FORMAT, DOT, LHS_FORMAT, DOT_PRECISION, BLOCK_K, FP8_NATIVE)
        a_ptrs += BLOCK_K * stride_hk
    acc = apply_scales(acc, bs_ptr, offs_n, n_ok, stride_sn, hs_ptr, rows, row_ok, FORMAT, DOT)

    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + rows[:, None] * stride_op + offs_n[None, :] * stride_on
    out_mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        if WEIGHT_ON_OUTPUT:
            acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptrs, acc, mask=out_mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _reduce_partials_kernel(
    part_ptr, out_ptr, weights_ptr, sorted_pair_ptr, num_padded_ptr, num_pairs, N,
    stride_ps, stride_pp, stride_op,
    SPLIT_K: tl.constexpr, SWIGLU: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[p, :N] = epilogue(sum over splits of part[s, p]) for the real rows of one aligned block.

    SWIGLU: part rows hold [g | u] (2N columns) and out = silu(g) * u; WEIGHTED: out *= w[p]."""
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    rows = pairs.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols[None, :] < N)
    src = part_ptr + rows[:, None] * stride_pp + cols[None, :]
    slice_stride = stride_ps.to(tl.int64)  # S * P * W can pass 2^31
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the sum does not depend on scheduling
        acc += tl.load(src + s * slice_stride, mask=mask, other=0.0)
    if SWIGLU:
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            up += tl.load(src + s * slice_stride + N, mask=mask, other=0.0)
        acc = acc * tl.sigmoid(acc) * up
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_op + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_plan(reduce_width: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(slices, elements per slice) for splitting a reduction of `reduce_width` into at most
    `split_k` slices of whole BLOCK_K steps; never an empty slice (so every partial gets written)."""
    steps = triton.cdiv(reduce_width, block_k)
    per_slice = triton.cdiv(steps, max(1, min(split_k, steps))) * block_k
    return triton.cdiv(reduce_width, per_slice), per_slice


def multiply_gate_up(
    x: torch.Tensor,
    gate_up: torch.Tensor | QuantizedTensor,
    routing: AlignedRouting,
    topk_weights: torch.Tensor,
    weight_on_input: bool,
    config: MoeConfig,
    dot: str | None = None,
) -> torch.Tensor:
    """h [P, I] = silu(g) * u for every aligned pair (Triton); rows of skipped pairs are garbage.
    gate_up: float [E, H, 2I] in x's dtype, or fp8 / mxfp8 / mxfp4 (moe_narrow.py; `dot` picks the
    dot form, default `choose_dot`'s)."""
    T, H = x.shape
    w = weight_operand(gate_up)
    E, _, two_i = w.shape
    top_k = _check(x, w, routing, topk_weights, config, H)
    I = two_i // 2
    if w.shape[1] != H or two_i % 2:
        raise ValueError(f"gate_up {w.shape} must be [E, H={H}, 2I]")
    dot = _dot_form(w, x, dot)
    h = torch.empty(routing.num_pairs, I, dtype=x.dtype, device=x.device)
    if routing.max_blocks == 0:
        return h
    weights = topk_weights.reshape(-1).to(x.dtype).contiguous()  # the reference rounds w to x dtype too
    splits, per_split = split_plan(H, config.block_k, config.split_k)
    out = h if splits == 1 else torch.empty(splits, routing.num_pairs, 2 * I, dtype=torch.float32, device=x.device)
    stride_os = 0 if splits == 1 else out.stride(0)
    grid = (routing.max_blocks * triton.cdiv(I, config.block_n), splits)
    a, a_scale = quantize_activations(x) if dot == "fp8" else (x, x)
    _gate_up_kernel[grid](
        a, a_scale, w.data, w.scale, out, weights, routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        routing.num_pairs, I, H, routing.max_blocks, per_split,
        a.stride(0), a.stride(1), *w.strides, *w.scale_strides,
        stride_os, out.stride(-2), out.stride(-1),
        TOP_K=top_k, WEIGHT_ON_INPUT=weight_on_input, DOT_PRECISION=_dot_precision(x.dtype),
        FORMAT=w.format, DOT=dot, LHS_FORMAT=_LHS_FORMAT.get(x.dtype, ""), FP8_NATIVE=fp8_native(x.device),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        SPLIT_K=splits, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        _reduce_partials(out, h, weights, routing, swiglu=True, weighted=False)
    return h


def multiply_down(
    h: torch.Tensor,
    down: torch.Tensor | QuantizedTensor,
    routing: AlignedRouting,
    topk_weights: torch.Tensor,
    weight_on_output: bool,
    config: MoeConfig,
    out: torch.Tensor | None = None,
    dot: str | None = None,
) -> torch.Tensor:
    """y [P, H] = h[p] @ down[e] for every aligned pair (Triton); other rows of `out` are untouched.
    down: float [E, I, H] in h's dtype, or narrow as in `multiply_gate_up`."""
    P, I = h.shape
    w = weight_operand(down)
    E, _, H = w.shape
    _check(h, w, routing, topk_weights, config, I, rows=P)
    if w.shape[1] != I:
        raise ValueError(f"down {w.shape} must be [E, I={I}, H]")
    dot = _dot_form(w, h, dot)
    if out is None:
        out = torch.empty(P, H, dtype=h.dtype, device=h.device)
    if out.shape != (P, H) or out.dtype != h.dtype:
        raise ValueError(f"out must be a {h.dtype} [{P}, {H}] tensor, got {out.dtype} {tuple(out.shape)}")
    if routing.max_blocks == 0:
        return out
    weights = topk_weights.reshape(-1).to(h.dtype).contiguous()  # the reference rounds w to x dtype too
    splits, per_split = split_plan(I, config.block_k, config.split_k)
    dest = out if splits == 1 else torch.empty(splits, P, H, dtype=torch.float32, device=h.device)
    stride_os = 0 if splits == 1 else dest.stride(0)
    grid = (routing.max_blocks * triton.cdiv(H, config.block_n), splits)
    a, a_scale = quantize_activations(h) if dot == "fp8" else (h, h)
    _down_kernel[grid](
        a, a_scale, w.data, w.scale, dest, weights, routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        routing.num_pairs, H, I, routing.max_blocks, per_split,
        a.stride(0), a.stride(1), *w.strides, *w.scale_strides,
        stride_os, dest.stride(-2), dest.stride(-1),
        WEIGHT_ON_OUTPUT=weight_on_output, DOT_PRECISION=_dot_precision(h.dtype),
        FORMAT=w.format, DOT=dot, LHS_FORMAT=_LHS_FORMAT.get(h.dtype, ""), FP8_NATIVE=fp8_native(h.device),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        SPLIT_K=splits, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        _reduce_partials(dest, out, weights, routing, swiglu=False, weighted=weight_on_output)
    return out


def _reduce_partials(partials: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, routing: AlignedRouting,
                     swiglu: bool, weighted: bool) -> None:
    """out rows of the aligned pairs from fp32 partials [S, P, W] (W = 2N with swiglu, else N)."""
    if out.stride(-1) != 1:
        raise ValueError("the reduce pass writes rows with unit column stride")
    splits, _, width = partials.shape
    n = width // 2 if swiglu else width
    block_n = max(16, min(triton.next_power_of_2(n), REDUCE_TILE // routing.block_m))
    grid = (routing.max_blocks, triton.cdiv(n, block_n))
    _reduce_partials_kernel[grid](
        partials, out, weights, routing.sorted_pair_ids, routing.num_padded, routing.num_pairs, n,
        partials.stride(0), partials.stride(1), out.stride(0),
        SPLIT_K=splits, SWIGLU=swiglu, WEIGHTED=weighted, BLOCK_M=routing.block_m, BLOCK_N=block_n,
    )


def multiply_gate_up_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    routing: AlignedRouting,
    topk_weights: torch.Tensor,
    weight_on_input: bool,
) -> torch.Tensor:
    """The gate_up GEMM in torch, block by block; rows of pairs no block computes are zero."""
    top_k = topk_weights.shape[1]
    I = gate_up.shape[2] // 2
    weights = topk_weights.reshape(-1).to(x.dtype)
    h = torch.zeros(routing.num_pairs, I, dtype=x.dtype, device=x.device)
    for e, pairs in _pairs_by_expert(routing):
        a = x[pairs // top_k]
        if weight_on_input:
            a = a * weights[pairs, None]
        gate, up = (a @ gate_up[e]).chunk(2, dim=-1)
        h[pairs] = torch.nn.functional.silu(gate) * up
    return h


def multiply_down_reference(
    h: torch.Tensor,
    down: torch.Tensor,
    routing: AlignedRouting,
    topk_weights: torch.Tensor,
    weight_on_output: bool,
) -> torch.Tensor:
    """The down GEMM in torch, block by block; rows of pairs no block computes are zero."""
    weights = topk_weights.reshape(-1).to(h.dtype)
    y = torch.zeros(routing.num_pairs, down.shape[2], dtype=h.dtype, device=h.device)
    for e, pairs in _pairs_by_expert(routing):
        out = h[pairs] @ down[e]
        y[pairs] = out * weights[pairs, None] if weight_on_output else out
    return y


def _pairs_by_expert(routing: AlignedRouting):
    """(expert, pair ids) for each expert with rows in the layout, padding removed."""
    used = int(routing.num_padded.item())
    blocks = routing.block_expert_ids[: used // routing.block_m].long()
    rows = routing.sorted_pair_ids[:used].long().view(-1, routing.block_m)
    for e in torch.unique(blocks).tolist():
        pairs = rows[blocks == e].flatten()
        yield e, pairs[pairs < routing.num_pairs]


def is_interpreted() -> bool:
    """Whether these kernels were built for Triton's interpreter (TRITON_INTERPRET=1 at import time)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    return isinstance(_gate_up_kernel, InterpretedFunction)


def _dot_precision(dtype: torch.dtype) -> str | None:
    # fp32: "ieee", not TF32, so fp32 results track the reference; 16-bit inputs: the target's default.
    return "ieee" if dtype == torch.float32 else None


def _check(a: torch.Tensor, w: WeightOperand, routing: AlignedRouting, topk_weights: torch.Tensor,
           config: MoeConfig, inner: int, rows: int | None = None) -> int:
    """Shared shape/dtype checks; returns K (slots per token)."""
    if a.dim() != 2:
        raise ValueError(f"expected a 2-D input and 3-D expert weights, got {tuple(a.shape)} and {w.shape}")
    if w.format == "float" and a.dtype != w.data.dtype:
        raise ValueError(f"input dtype {a.dtype} differs from expert weight dtype {w.data.dtype}")
    if a.device != w.data.device or a.device != routing.sorted_pair_ids.device:
        raise ValueError("input, expert weights and routing must be on one device")
    if topk_weights.dim() != 2 or topk_weights.numel() != routing.num_pairs:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must be [T, K] with T*K = {routing.num_pairs}")
    if rows is not None and rows != routing.num_pairs:
        raise ValueError(f"input has {rows} rows, routing has {routing.num_pairs} pairs")
    if config.block_m != routing.block_m:
        raise ValueError(f"config.block_m {config.block_m} differs from the routing's block_m {routing.block_m}")
    if w.format != "float" and config.block_k < MIN_BLOCK_K:
        raise ValueError(f"{w.format} expert weights need block_k >= {MIN_BLOCK_K} (got {config.block_k})")
    return topk_weights.shape[1]


def _dot_form(w: WeightOperand, a: torch.Tensor, dot: str | None) -> str:
    if dot is None:
        return choose_dot(w.format, a.dtype, a.device)
    check_dot(dot, w.format, a.dtype, a.device)
    return dot
