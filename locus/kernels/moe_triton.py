"""The Triton fused-MoE path: align -> gate_up GEMM (SwiGLU epilogue) -> down GEMM -> sum over slots.

With config.split_k > 1 (decode batches that touch few experts) each GEMM runs its reduction in
slices and a reduce pass adds them (moe_gemm.py); the call is otherwise the same. Every launch is
sized from T, K, E and the config alone, and nothing is read back to the host, so the call is
sync-free and can be captured in a CUDA graph (the config is looked up from T when the graph is
captured and stays fixed for its replays).

Same contract as `fused_moe_reference` (moe_reference.py), which it is tested against:
routed-expert output [T, H] for x [T, H], with the routing weight on the expert's input (Llama-4) or
on its output (Qwen3 / DeepSeek), and an optional global -> local expert map for expert parallelism.
The expert weights may be fp8 / mxfp8 / mxfp4 QuantizedTensors (then the contract is
`fused_moe_quantized_reference`'s, or `fused_moe_w8a8_reference`'s where the "fp8" form runs): the
GEMMs read them narrow (moe_narrow.py) in the dot form `choose_dot` picks for the device, dtype and
batch (moe_dot_forms.py); if that form fails to build here, the call and every later one for that
(format, dtype, device) fall back to the portable "dequant" form with one warning.

(The file is not called fused_moe.py: `locus.kernels.fused_moe` is the public function, and a
submodule of the same name would replace it on the package once imported.)

Shape legend: T tokens, K slots, P = T*K pairs, E local experts, H hidden, I expert width.
"""

from __future__ import annotations

import logging

import torch

from locus.kernels.formats import QuantizedTensor
from locus.kernels.moe_align import AlignedRouting, align_routing
from locus.kernels.moe_configs import MoeConfig, device_name, get_config
from locus.kernels.moe_gemm import is_interpreted, multiply_down, multiply_gate_up
from locus.kernels.moe_dot_forms import choose_dot
from locus.kernels.moe_narrow import weight_format

log = logging.getLogger("locus.kernels")
_FALLBACK: set[tuple] = set()  # (format, dtype, device) whose chosen dot form failed to build: "dequant"
_ANNOUNCED: set[tuple] = set()  # (format, dtype, device, dot) already logged


def fused_moe_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor | QuantizedTensor,
    down: torch.Tensor | QuantizedTensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_on_input: bool = True,
    expert_map: torch.Tensor | None = None,
    config: MoeConfig | None = None,
    dot: str | None = None,
) -> torch.Tensor:
    """Routed-expert output [T, H] (Triton kernels); `config` overrides the tuned-table lookup, `dot`
    the dot form of narrow weights (moe_dot_forms.DOT_FORMS; default: `choose_dot`'s, with fallback)."""
    check_runnable(x)
    T, H = x.shape
    E, _, two_i = gate_up.shape
    fmt = weight_format(gate_up)
    if weight_format(down) != fmt:
        raise ValueError(f"gate_up is {fmt} but down is {weight_format(down)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T={T}, K]")
    K = topk_ids.shape[1]
    if config is None:
        config = get_config(T, K, E, two_i // 2, H, x.dtype, device_name(x.device), weights=fmt)

    routing = align_routing(topk_ids, E, config.block_m, expert_map)
    if fmt == "float" or dot is not None:
        return _experts(x, gate_up, down, routing, topk_weights, weight_on_input, config, dot)
    key = (fmt, x.dtype, str(x.device))
    chosen = "dequant" if key in _FALLBACK else choose_dot(fmt, x.dtype, x.device, T * K / E)
    if chosen == "dequant":
        return _experts(x, gate_up, down, routing, topk_weights, weight_on_input, config, chosen)
    try:
        out = _experts(x, gate_up, down, routing, topk_weights, weight_on_input, config, chosen)
    except Exception as exc:  # noqa: BLE001 - a fast form this Triton or GPU cannot build: the portable form
        out = _experts(x, gate_up, down, routing, topk_weights, weight_on_input, config, "dequant")
        _FALLBACK.add(key)  # only now: had the portable form failed too, the error is not the dot form's
        log.warning("Triton fused MoE: the %r dot form failed on %s experts (%s: %s); using 'dequant'", chosen, fmt,
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    return out


def _experts(x, gate_up, down, routing: AlignedRouting, topk_weights, weight_on_input: bool, config: MoeConfig,
             dot: str | None) -> torch.Tensor:
    """Both GEMMs and the slot sum for an aligned batch."""
    T, K = topk_weights.shape
    if dot is not None:
        _announce(weight_format(gate_up), x, dot)
    h = multiply_gate_up(x, gate_up, routing, topk_weights, weight_on_input, config, dot)  # [P, I]
    # Pairs nobody computes (expert not held here) must contribute zero, so start from zeros.
    y = torch.zeros(T * K, x.shape[1], dtype=x.dtype, device=x.device)
    multiply_down(h, down, routing, topk_weights, not weight_on_input, config, out=y, dot=dot)  # [P, H]
    return sum_slots(y, T, K)


def _announce(fmt: str, x: torch.Tensor, dot: str) -> None:
    """Log once which dot form reads which narrow weights where."""
    key = (fmt, x.dtype, str(x.device), dot)
    if fmt == "float" or key in _ANNOUNCED:
        return
    _ANNOUNCED.add(key)
    log.info("Triton fused MoE reads %s expert weights with the %r dot form (%s activations, %s)", fmt, dot,
             str(x.dtype).removeprefix("torch."), device_name(x.device))


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

