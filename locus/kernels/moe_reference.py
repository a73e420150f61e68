"""Torch reference for the fused-MoE expert computation (the Triton kernels are checked against it).

For each token t and each of its K slots: expert e = topk_ids[t, k], weight w = topk_weights[t, k],
    y_tk = (silu(g) * u) @ down[e]   where [g | u] = x_in @ gate_up[e]
with x_in = w * x[t] when the weight scales the input (Llama-4), else x_in = x[t] and y_tk is scaled by w
(Qwen3 / DeepSeek). The output row is sum_k y_tk.

Only the selected experts run: the T*K (token, slot) pairs are sorted by expert, then one of two
strategies multiplies each expert's rows (same math, chosen per call by `strategy="auto"`):
- "loop": one pair of matmuls per expert with rows, on its contiguous slice of the sorted pairs.
  Best when experts hold many rows (prefill): no padding, and the per-expert launch cost is amortised.
- "padded": the rows are scattered into an [E, M, H] block (M = the busiest expert's row count) and
  two batched matmuls run every expert at once. Best for small batches (decode): there each matmul
  costs about as much for 1 row as for 16 (reading the expert's weights dominates), so the padding
  is nearly free while 2*E small matmuls and their Python dispatch become two calls.
Running every expert on every token (as transformers' Llama-4 does) costs E/K times the FLOPs.

Shape legend: T tokens, K slots per token, E experts held here, H hidden, I expert width.
    x            [T, H]
    gate_up      [E, H, 2I]   (gate = first I columns, up = last I)
    down         [E, I, H]
    topk_ids     [T, K]       global expert ids (int)
    topk_weights [T, K]       float
    expert_map   [E_global]   global id -> local index into gate_up/down, or -1 if not held here
    out          [T, H]       same dtype as x; pairs whose expert is not held contribute zero
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


STRATEGIES = ("auto", "loop", "padded")
PADDED_MAX_ROWS = 16  # up to this many rows a CPU/GPU matmul costs about what one row costs


def choose_strategy(counts: list[int]) -> str:
    """"padded" when no expert has more than PADDED_MAX_ROWS rows and at least half the experts have
    some (the padded matmuls read every expert's weights, so they only pay when most are used)."""
    busy = sum(n > 0 for n in counts)
    return "padded" if busy and max(counts) <= PADDED_MAX_ROWS and 2 * busy >= len(counts) else "loop"


@dataclass
class SortedPairs:
    """The T*K (token, slot) pairs sorted by local expert; pairs for no expert held here sort first.
    Shape legend as above, P = T*K."""
    order: torch.Tensor  # [P] pair index (t*K + k) of each sorted row
    experts: torch.Tensor  # [P] local expert of each sorted row (-1: not held here)
    sizes: torch.Tensor  # [E] rows per expert
    counts: list[int]  # sizes, on the host
    start: int  # rows before this one are skipped pairs
    x: torch.Tensor  # [P, H] each row's input, times its weight when the weight scales the input
    weights: torch.Tensor  # [P, 1] each row's routing weight, in x's dtype


def check_shapes(x, gate_up, down, topk_ids, topk_weights) -> tuple[int, int, int, int, int]:
    """(T, H, K, E, I) of a fused-MoE call, or ValueError naming the mismatch."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E, _, two_i = gate_up.shape
    I = two_i // 2
    if gate_up.shape[1] != H or down.shape != (E, I, H):
        raise ValueError(f"expert weights gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} do not match hidden {H}")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T={T}, K]")
    return T, H, K, E, I


def sort_pairs(x, topk_ids, topk_weights, num_experts: int, weight_on_input: bool,
               expert_map: torch.Tensor | None) -> SortedPairs:
    """Sort the pairs by expert once, so each expert multiplies one contiguous slice of rows."""
    T, K = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:  # global -> local; -1 = not held here (a -1 id stays -1)
        ids = torch.where(ids >= 0, expert_map.to(ids.device).long()[ids.clamp(min=0)], ids)
    weights = topk_weights.reshape(-1).to(x.dtype)
    token_of_pair = torch.arange(T * K, device=x.device) // K
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    sizes = torch.bincount(sorted_ids[sorted_ids >= 0], minlength=num_experts)  # [E] rows per expert
    counts = sizes.tolist()
    x_sorted = x[token_of_pair[order]]  # [T*K, H]
    w_sorted = weights[order, None]
    if weight_on_input:
        x_sorted = x_sorted * w_sorted
    return SortedPairs(order, sorted_ids, sizes, counts, T * K - sum(counts), x_sorted, w_sorted)


def sum_slots(y_sorted: torch.Tensor, order: torch.Tensor, T: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """Un-sort the rows' outputs [T*K, H] with one scatter (no per-expert index_add, slow on CPU for
    small slices) and sum each token's K slots in float32: [T, H] in dtype."""
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    if K == 1:
        return y.to(dtype)
    return y.view(T, K, y.shape[1]).float().sum(dim=1).to(dtype)


def fused_moe_reference(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_on_input: bool = True,
    expert_map: torch.Tensor | None = None,
    strategy: str = "auto",
) -> torch.Tensor:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    T, H, K, E, I = check_shapes(x, gate_up, down, topk_ids, topk_weights)
    pairs = sort_pairs(x, topk_ids, topk_weights, E, weight_on_input, expert_map)
    return multiply_sorted(pairs, gate_up, down, T, K, weight_on_input, x.dtype, strategy)


def multiply_sorted(pairs: SortedPairs, gate_up: torch.Tensor, down: torch.Tensor, T: int, K: int,
                    weight_on_input: bool, dtype: torch.dtype, strategy: str = "auto") -> torch.Tensor:
    """The reference's expert matmuls over pairs already sorted by sort_pairs: [T, H] in dtype."""
    counts, start, x_sorted = pairs.counts, pairs.start, pairs.x
    E, H = gate_up.shape[0], x_sorted.shape[1]
    # Skipped pairs (id -1) sort first and their rows stay zero.
    y_sorted = torch.zeros(T * K, H, dtype=x_sorted.dtype, device=x_sorted.device)
    if strategy == "auto":
        strategy = choose_strategy(counts)
    if strategy == "padded" and start < T * K:
        # Row r of the sorted pairs goes to expert experts[r], at its rank among that expert's rows.
        held = slice(start, T * K)
        experts = pairs.experts[held]
        first_row = pairs.sizes.cumsum(0) - pairs.sizes  # [E] where each expert's rows begin within `held`
        rank = torch.arange(T * K - start, device=x_sorted.device) - first_row[experts]
        x_pad = x_sorted.new_zeros(E, max(counts), H)  # [E, M, H]
        x_pad[experts, rank] = x_sorted[held]
        gate, up = torch.bmm(x_pad, gate_up).chunk(2, dim=-1)  # [E, M, I] each
        y_sorted[held] = torch.bmm(F.silu(gate) * up, down)[experts, rank]
    elif strategy == "loop":
        for e, n in enumerate(counts):
            if n == 0:
                continue
            block = slice(start, start + n)
            gate, up = (x_sorted[block] @ gate_up[e]).chunk(2, dim=-1)
            y_sorted[block] = (F.silu(gate) * up) @ down[e]
            start += n
    if not weight_on_input:
        y_sorted = y_sorted * pairs.weights
    return sum_slots(y_sorted, pairs.order, T, K, dtype)
