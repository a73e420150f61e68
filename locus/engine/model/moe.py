"""The MoE feed-forward blocks: RoutedMoE, the forward every family's block shares (router -> the
family's rule -> the routed experts, plus its shared expert if it has one), and Llama-4's MoEBlock.
Qwen3's and DeepSeek's blocks (qwen3.py, deepseek.py) subclass RoutedMoE with their own rule.

Llama-4's:

# T tokens, E experts, K top-k, H hidden, I expert width
    logits  = x @ W_router^T                                 [T, E]
    top-k   = route_llama4(logits)  ids, sigmoid weights      [T, K]
    routed  = sum_k expert_{e_k}(w_k * x)                     [T, H]   weight scales the INPUT
    out     = shared_expert(x) + routed

Expert weights are stored fused, as the checkpoints do: gate_up [E, H, 2I] (gate first), down [E, I, H],
as float Parameters or, quantized (--quantize-experts, FP8 checkpoints), as QuantizedTensors in the
same logical shapes (locus/kernels/moe_quantized.py).
The expert computation is one `fused_moe` call that runs only the selected experts; `moe_backend`
picks the Triton kernels or the torch reference.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from locus.engine.model.config import ModelConfig
from locus.engine.model.layers import SwiGLU
from locus.kernels import fused_moe
from locus.kernels.formats import QuantizedTensor, quantize
from locus.kernels.moe_quantized import check_expert_weights, quantize_experts
from locus.routing.gate import TopK, route_llama4


class Experts(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        E, H, I = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        # None: all E experts, row e = expert e. An expert-parallel rank holds only its slots' experts
        # (locus/engine/model/slices.py): row j = expert expert_ids[j].
        self.expert_ids: list[int] | None = None

    @property
    def weight_format(self) -> str | None:
        """The narrow format the expert weights are held in (moe_quantized.py), None for float weights."""
        return self.gate_up_proj.format if isinstance(self.gate_up_proj, QuantizedTensor) else None

    def hold_quantized(self, gate_up: QuantizedTensor, down: QuantizedTensor) -> None:
        """Replace the float weights by quantized ones (plain attributes: a QuantizedTensor is no
        Parameter, so the model's .to(dtype) never widens it; it lives on the device it was made on)."""
        check_expert_weights(gate_up, down)
        for name, q in (("gate_up_proj", gate_up), ("down_proj", down)):
            old = getattr(self, name)
            if tuple(q.shape) != tuple(old.shape):
                raise ValueError(f"quantized {name} has shape {tuple(q.shape)}, the layer holds {tuple(old.shape)}")
            if name in self._parameters:
                del self._parameters[name]
            object.__setattr__(self, name, q)

    def expect_quantized(self) -> None:
        """Keep only the shapes of the float weights (meta tensors, no Parameters) until hold_quantized
        fills them: a quantized checkpoint's loader then allocates no float experts."""
        for name in ("gate_up_proj", "down_proj"):
            weight = self._parameters.pop(name)
            object.__setattr__(self, name, torch.empty(weight.shape, device="meta"))

    def quantize(self, fmt: str) -> None:
        """Hold the experts in `fmt` (quantized once, from the float weights held now)."""
        self.hold_quantized(*quantize_experts(self.gate_up_proj, self.down_proj, fmt))


class RoutedMoE(nn.Module):
    """What every family's MoE block is and offers the expert-parallel form (locus/engine/ep/layer.py):
    the router, `rule` (router logits -> TopK), the experts, where the routing weight applies
    (`weight_on_input`), the shared expert (or None); one forward for all of them. A family's block
    subclasses it and passes its rule and shared expert (a family whose rule needs its own parameters
    defines `rule` as a method and passes None)."""

    weight_on_input = True

    def __init__(self, config: ModelConfig, moe_backend: str, rule, shared_expert: nn.Module | None):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.moe_backend = moe_backend
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        if rule is not None:
            self.rule = rule
        self.experts = Experts(config)
        self.shared_expert = shared_expert
        # The MX format the routed experts' input is rounded to, as an expert-parallel dispatch in that
        # format delivers it (locus/engine/ep/payload.py), in one process: the reference for the EP
        # parity tests and bench/quantized_quality.py's dispatch rows. None: the input as it is.
        self.dispatch_format: str | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, TopK]:
        if self.experts.expert_ids is not None:
            raise RuntimeError("this block holds a rank's expert slice: run it through apply_expert_parallel")
        topk = self.rule(self.router(x))
        dispatched = x if self.dispatch_format is None else quantize(x, self.dispatch_format, axis=-1).dequantize(x.dtype)
        routed = fused_moe(
            dispatched, self.experts.gate_up_proj, self.experts.down_proj, topk.ids, topk.weights.to(x.dtype),
            weight_on_input=self.weight_on_input, backend=self.moe_backend,
        )
        return (routed if self.shared_expert is None else self.shared_expert(x) + routed), topk


class MoEBlock(RoutedMoE):
    """Llama-4's: sigmoid top-k, the weight on the expert's input, one shared expert."""

    weight_on_input = True

    def __init__(self, config: ModelConfig, moe_backend: str = "torch"):
        super().__init__(config, moe_backend, functools.partial(route_llama4, top_k=config.num_experts_per_tok),
                         SwiGLU(config.hidden_size, config.intermediate_size))
