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

import torch
import torch.nn.functional as F


STRATEGIES = ("auto", "loop", "padded")
PADDED_MAX_ROWS = 16  # up to this many rows a CPU/GPU matmul costs about what one row costs


def choose_strategy(counts: list[int]) -> str:
    """"padded" when no expert has more than PADDED_MAX_ROWS rows and at least half the experts have
    some (the padded matmuls read every expert's weights, so they only pay when most are used)."""
    busy = sum(n > 0 for n in counts)
    return "padded" if busy and max(counts) <= PADDED_MAX_ROWS and 2 * busy >= len(counts) else "loop"


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
    ids = topk_ids.reshape(-1).long()
    if expert_map is not None:  # global -> local; -1 = not held here (a -1 id stays -1)
        ids = torch.where(ids >= 0, expert_map.to(ids.device).long()[ids.clamp(min=0)], ids)
    weights = topk_weights.reshape(-1).to(x.dtype)
    token_of_pair = torch.arange(T * K, device=x.device) // K

    # Sort the pairs by expert once, so each expert multiplies one contiguous slice; skipped pairs
    # (id -1) sort first and stay zero. Results are un-sorted with one scatter and summed over K:
    # no per-expert index_add (slow on CPU for small slices).
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    sizes = torch.bincount(sorted_ids[sorted_ids >= 0], minlength=E)  # [E] rows per expert
    counts = sizes.tolist()
    start = T * K - sum(counts)
    rows = token_of_pair[order]
    x_sorted = x[rows]  # [T*K, H]
    w_sorted = weights[order, None]
    if weight_on_input:
        x_sorted = x_sorted * w_sorted
    y_sorted = torch.zeros(T * K, H, dtype=x.dtype, device=x.device)
    if strategy == "auto":
        strategy = choose_strategy(counts)
    if strategy == "padded" and start < T * K:
        # Row r of the sorted pairs goes to expert sorted_ids[r], at its rank among that expert's rows.
        held = slice(start, T * K)
        experts = sorted_ids[held]
        first_row = sizes.cumsum(0) - sizes  # [E] where each expert's rows begin within `held`
        rank = torch.arange(T * K - start, device=x.device) - first_row[experts]
        x_pad = x.new_zeros(E, max(counts), H)  # [E, M, H]
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
        y_sorted = y_sorted * w_sorted
    y = torch.empty_like(y_sorted)
    y[order] = y_sorted
    if K == 1:
        return y
    return y.view(T, K, H).float().sum(dim=1).to(x.dtype)
