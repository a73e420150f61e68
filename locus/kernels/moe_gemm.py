"""Grouped GEMMs of fused MoE: every BLOCK_M-row block of aligned pairs times its own expert's weights.

After the align step (moe_align.py) the pairs sit expert by expert in BLOCK_M-row blocks. A program
owns one (block, N-tile): it reads the block's expert id, gathers the block's A rows by pair id, and
multiplies them by a [H or I, BLOCK_N] slice of that expert's weight. Padding rows (pair id == P) are
masked on load and never stored; blocks past the padded end return at once. Two kernels:

  gate_up:  h[p] = silu(g) * u,  [g | u] = a[p] @ gate_up[e]   a[p] = x[p // K], scaled by w[p] on
            input. Each program keeps a gate and an up accumulator for the same N columns, so the
            SwiGLU epilogue needs no second pass and the [P, 2I] product is never written.
  down:     y[p] = h[p] @ down[e], scaled by w[p] when the weight goes on the output.

Tiles are visited GROUP_M blocks at a time down M before moving along N (Triton tutorial 03): nearby
blocks usually share an expert, so a weight tile loaded into L2 serves the whole group.
Accumulation is fp32. With fp32 inputs tl.dot runs at "ieee" precision (no TF32) so fp32 results
match the torch reference tightly.

Shape legend: T tokens, K slots, P = T*K pairs, E local experts, H hidden, I expert width.
    x        [T, H]        gate_up [E, H, 2I]   (gate = first I columns)
    h        [P, I]        down    [E, I, H]
    y        [P, H]        topk_weights [T, K] (read flat as [P])
Rows of h and y belong to pairs; rows of pairs that no block computes are not written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from locus.kernels.moe_align import AlignedRouting
from locus.kernels.moe_configs import MoeConfig


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
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, weights_ptr, sorted_pair_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, N, H, max_blocks,
    stride_xt, stride_xh, stride_we, stride_wh, stride_wn, stride_hp, stride_hn,
    TOP_K: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(max_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)  # int64: expert * stride_we can pass 2^31
    pairs = tl.load(sorted_pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh
    g_ptrs = w_ptr + expert * stride_we + offs_k[:, None] * stride_wh + offs_n[None, :] * stride_wn
    u_ptrs = g_ptrs + N * stride_wn  # up columns sit N = I columns after the gate columns
    if WEIGHT_ON_INPUT:
        # Same rounding as the reference, which scales x by w in x's dtype before the GEMM.
        w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(x_ptr.dtype.element_ty)

    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(H, BLOCK_K)):
        k_ok = offs_k < H - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if WEIGHT_ON_INPUT:
            a = a * w[:, None]
        b_mask = k_ok[:, None] & (offs_n[None, :] < N)
        acc_g = tl.dot(a, tl.load(g_ptrs, mask=b_mask, other=0.0), acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, tl.load(u_ptrs, mask=b_mask, other=0.0), acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh

    h = acc_g * tl.sigmoid(acc_g) * acc_u  # silu(g) * u, still in fp32
    h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * stride_hp + offs_n[None, :] * stride_hn
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, y_ptr, weights_ptr, sorted_pair_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, N, I, max_blocks,
    stride_hp, stride_hk, stride_we, stride_wk, stride_wn, stride_yp, stride_yn,
    WEIGHT_ON_OUTPUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_coords(max_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_pair_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    rows = pairs.to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_hp + offs_k[None, :] * stride_hk
    b_ptrs = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(I, BLOCK_K)):
        k_ok = offs_k < I - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_hk
        b_ptrs += BLOCK_K * stride_wk

    if WEIGHT_ON_OUTPUT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + rows[:, None] * stride_yp + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def multiply_gate_up(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    routing: AlignedRouting,
    topk_weights: torch.Tensor,
    weight_on_input: bool,
    config: MoeConfig,
) -> torch.Tensor:
    """h [P, I] = silu(g) * u for every aligned pair (Triton); rows of skipped pairs are garbage."""
    T, H = x.shape
    E, _, two_i = gate_up.shape
    top_k = _check(x, gate_up, routing, topk_weights, config, H)
    I = two_i // 2
    if gate_up.shape[1] != H or two_i % 2:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must be [E, H={H}, 2I]")
    h = torch.empty(routing.num_pairs, I, dtype=x.dtype, device=x.device)
    if routing.max_blocks == 0:
        return h
    weights = topk_weights.reshape(-1).to(x.dtype).contiguous()  # the reference rounds w to x dtype too
    grid = (routing.max_blocks * triton.cdiv(I, config.block_n),)
    _gate_up_kernel[grid](
        x, gate_up, h, weights, routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        routing.num_pairs, I, H, routing.max_blocks,
        x.stride(0), x.stride(1), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2),
        h.stride(0), h.stride(1),
        TOP_K=top_k, WEIGHT_ON_INPUT=weight_on_input, DOT_PRECISION=_dot_precision(x.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return h


def multiply_down(
    h: torch.Tensor,
    down: torch.Tensor,
    routing: AlignedRouting,
    topk_weights: torch.Tensor,
    weight_on_output: bool,
    config: MoeConfig,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [P, H] = h[p] @ down[e] for every aligned pair (Triton); other rows of `out` are untouched."""
    P, I = h.shape
    E, _, H = down.shape
    _check(h, down, routing, topk_weights, config, I, rows=P)
    if down.shape[1] != I:
        raise ValueError(f"down {tuple(down.shape)} must be [E, I={I}, H]")
    if out is None:
        out = torch.empty(P, H, dtype=h.dtype, device=h.device)
    if out.shape != (P, H) or out.dtype != h.dtype:
        raise ValueError(f"out must be a {h.dtype} [{P}, {H}] tensor, got {out.dtype} {tuple(out.shape)}")
    if routing.max_blocks == 0:
        return out
    weights = topk_weights.reshape(-1).to(h.dtype).contiguous()  # the reference rounds w to x dtype too
    grid = (routing.max_blocks * triton.cdiv(H, config.block_n),)
    _down_kernel[grid](
        h, down, out, weights, routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        routing.num_pairs, H, I, routing.max_blocks,
        h.stride(0), h.stride(1), down.stride(0), down.stride(1), down.stride(2),
        out.stride(0), out.stride(1),
        WEIGHT_ON_OUTPUT=weight_on_output, DOT_PRECISION=_dot_precision(h.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


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


def _check(a: torch.Tensor, w: torch.Tensor, routing: AlignedRouting, topk_weights: torch.Tensor,
           config: MoeConfig, inner: int, rows: int | None = None) -> int:
    """Shared shape/dtype checks; returns K (slots per token)."""
    if a.dim() != 2 or w.dim() != 3:
        raise ValueError(f"expected a 2-D input and 3-D expert weights, got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype != w.dtype:
        raise ValueError(f"input dtype {a.dtype} differs from expert weight dtype {w.dtype}")
    if a.device != w.device or a.device != routing.sorted_pair_ids.device:
        raise ValueError("input, expert weights and routing must be on one device")
    if topk_weights.dim() != 2 or topk_weights.numel() != routing.num_pairs:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must be [T, K] with T*K = {routing.num_pairs}")
    if rows is not None and rows != routing.num_pairs:
        raise ValueError(f"input has {rows} rows, routing has {routing.num_pairs} pairs")
    if config.block_m != routing.block_m:
        raise ValueError(f"config.block_m {config.block_m} differs from the routing's block_m {routing.block_m}")
    return topk_weights.shape[1]
