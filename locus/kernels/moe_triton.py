"""The Triton fused-MoE path: align -> gate_up GEMM (SwiGLU epilogue) -> down GEMM -> sum over slots.

With config.split_k > 1 (decode batches that touch few experts) each GEMM runs its reduction in
slices and a reduce pass adds them (moe_gemm.py); the call is otherwise the same. Every launch is
sized from T, K, E and the config alone, and nothing is read back to the host, so the call is
sync-free and can be captured in a CUDA graph (the config is looked up from T when the graph is
captured and stays fixed for its replays).

Same contract as `fused_moe_reference` (moe_reference.py), which it is tested against:
routed-expert output [T, H] for x [T, H], with the routing weight on the expert's input (Llama-4) or
on its output (Qwen3 / DeepSeek), and an optional global -> local expert map for expert parallelism.

(The file is not called fused_moe.py: `locus.kernels.fused_moe` is the public function, and a
submodule of the same name would replace it on the package once imported.)

Shape legend: T tokens, K slots, P = T*K pairs, E local experts, H hidden, I expert width.
"""

from __future__ import annotations

import torch

from locus.kernels.moe_align import align_routing
from locus.kernels.moe_configs import MoeConfig, device_name, get_config
from locus.kernels.moe_gemm import is_interpreted, multiply_down, multiply_gate_up


def fused_moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_on_input: bool = True,
    expert_map: torch.Tensor | None = None,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Routed-expert output [T, H] (Triton kernels); `config` overrides the tuned-table lookup."""
    check_runnable(x)
    T, H = x.shape
    E, _, two_i = gate_up.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T={T}, K]")
    K = topk_ids.shape[1]
    if config is None:
        config = get_config(T, K, E, two_i // 2, H, x.dtype, device_name(x.device))

    routing = align_routing(topk_ids, E, config.block_m, expert_map)
    h = multiply_gate_up(x, gate_up, routing, topk_weights, weight_on_input, config)  # [P, I]
    # Pairs nobody computes (expert not held here) must contribute zero, so start from zeros.
    y = torch.zeros(T * K, H, dtype=x.dtype, device=x.device)
    multiply_down(h, down, routing, topk_weights, not weight_on_input, config, out=y)  # [P, H]
    return sum_slots(y, T, K)


def sum_slots(y: torch.Tensor, T: int, K: int) -> torch.Tensor:
    """out [T, H] = sum over each token's K rows of y [T*K, H], accumulated in fp32 like the reference."""
    if K == 1:
        return y.view(T, y.shape[1])  # top-1 (Llama-4): nothing to reduce
    return y.view(T, K, y.shape[1]).sum(dim=1, dtype=torch.float32).to(y.dtype)


def check_runnable(x: torch.Tensor) -> None:
    """Fail with a clear message where Triton cannot run: CPU tensors without the interpreter."""
    if x.device.type == "cuda" or is_interpreted():
        return
    raise RuntimeError(
        "the Triton MoE backend needs CUDA tensors; on CPU it runs only under Triton's interpreter, "
        "with TRITON_INTERPRET=1 set before anything imports Triton"
    )

