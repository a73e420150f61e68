"""The Llama-4 MoE feed-forward block.

# T tokens, E experts, K top-k, H hidden, I expert width
    logits  = x @ W_router^T                                 [T, E]
    top-k   = route_llama4(logits)  ids, sigmoid weights      [T, K]
    routed  = sum_k expert_{e_k}(w_k * x)                     [T, H]   weight scales the INPUT
    out     = shared_expert(x) + routed

Expert weights are stored fused, as the checkpoints do: gate_up [E, H, 2I] (gate first), down [E, I, H].
The expert computation is one `fused_moe` call that runs only the selected experts; `moe_backend`
picks the Triton kernels or the torch reference.
"""

from __future__ import annotations

import torch
from torch import nn

from locus.engine.model.config import ModelConfig
from locus.engine.model.layers import SwiGLU
from locus.kernels import fused_moe
from locus.routing.gate import TopK, route_llama4


class Experts(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        E, H, I = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * I))
        self.down_proj = nn.Parameter(torch.empty(E, I, H))
        # None: all E experts, row e = expert e. An expert-parallel rank holds only its slots' experts
        # (locus/engine/ep/slices.py): row j = expert expert_ids[j].
        self.expert_ids: list[int] | None = None


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig, moe_backend: str = "torch"):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.moe_backend = moe_backend
        self.router = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = Experts(config)
        self.shared_expert = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, TopK]:
        if self.experts.expert_ids is not None:
            raise RuntimeError("this block holds a rank's expert slice: run it through apply_expert_parallel")
        topk = route_llama4(self.router(x), self.top_k)
        routed = fused_moe(
            x, self.experts.gate_up_proj, self.experts.down_proj, topk.ids, topk.weights.to(x.dtype),
            weight_on_input=True, backend=self.moe_backend,
        )
        return self.shared_expert(x) + routed, topk
