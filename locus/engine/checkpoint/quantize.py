"""`--quantize-experts`: hold the routed experts of a loaded model in a narrow format.

Quantized once, at load, from the weights the model holds then, layer by layer (one layer's float
experts and its quantized copy at a time). An expert-parallel rank's model holds only its slots'
experts (model/slices.py), so each rank quantizes only its own. The attention, router, shared expert,
dense layers and embeddings stay in the compute dtype: the routed experts are most of the bytes a
decode step reads, and where narrow weights pay (locus/kernels/moe_quantized.py, docs/formats.md).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from locus.engine.model.expert_rows import weight_nbytes
from locus.engine.model.model import Llama4ForCausalLM
from locus.kernels import resolve_backend
from locus.kernels.moe_cpu import CPU_MAX_ROWS_QUANTIZED
from locus.kernels.moe_dot_forms import DECODE_ROWS, choose_dot
from locus.kernels.moe_quantized import EXPERT_FORMATS, quantize_experts
from locus.errors import LocusError

log = logging.getLogger("locus.engine")


@dataclass
class ExpertQuantization:
    format: str
    layers: int
    bytes_before: int
    bytes_after: int

    def describe(self) -> str:
        mib = 1 << 20
        return (f"routed experts of {self.layers} MoE layers held in {self.format}: "
                f"{self.bytes_before / mib:.1f} MiB -> {self.bytes_after / mib:.1f} MiB")


def moe_layers(model: Llama4ForCausalLM):
    """The `Experts` module of each MoE layer."""
    return [model.model.layers[i].feed_forward.experts for i in model.config.moe_layers]


def quantize_model_experts(model: Llama4ForCausalLM, fmt: str) -> ExpertQuantization:
    """Quantize every MoE layer's routed experts to `fmt` (fp8, mxfp8, mxfp4). Experts already held
    in another narrow format (an FP8 checkpoint) are dequantized first, with a logged note."""
    if fmt not in EXPERT_FORMATS:
        raise LocusError(f"--quantize-experts {fmt!r}: choose one of {', '.join(EXPERT_FORMATS)}")
    before = after = 0
    for experts in moe_layers(model):
        before += _nbytes(experts)
        held = experts.weight_format
        if held == fmt:
            after += _nbytes(experts)
            continue
        if held is not None:
            log.info("experts held in %s are dequantized and requantized to %s", held, fmt)
            gate_up, down = experts.gate_up_proj.dequantize(), experts.down_proj.dequantize()
        else:
            gate_up, down = experts.gate_up_proj.float(), experts.down_proj.float()
        experts.hold_quantized(*quantize_experts(gate_up, down, fmt))
        after += _nbytes(experts)
    report = ExpertQuantization(fmt, len(model.config.moe_layers), before, after)
    if model.config.moe_layers:
        log.info("%s experts: %s", fmt, expert_kernel_path(model, fmt))
    return report


def expert_kernel_path(model: Llama4ForCausalLM, fmt: str) -> str:
    """Which code reads `fmt` expert weights in this model's MoE backend, in words (for the load log)."""
    backend = resolve_backend(model.model.layers[model.config.moe_layers[0]].feed_forward.moe_backend, model.device)
    if backend == "cpu":
        return (f"the CPU C kernel reads them narrow (up to {CPU_MAX_ROWS_QUANTIZED} rows an expert; the torch "
                f"reference above that)")
    if backend == "torch":
        return "the torch reference dequantizes the experts a batch uses, per call"
    decode = choose_dot(fmt, model.dtype, model.device, rows_per_expert=1)
    prefill = choose_dot(fmt, model.dtype, model.device, rows_per_expert=DECODE_ROWS + 1)
    forms = f"the {decode!r} dot form" + (f" ({prefill!r} for prefill-sized batches)" if prefill != decode else "")
    return f"the Triton kernels read them narrow with {forms} (locus/kernels/moe_narrow.py)"


def dequantize_model_experts(model: Llama4ForCausalLM) -> None:
    """Back to float Parameters in the model's dtype (every MoE backend reads the narrow formats; this
    is for comparing a model with its float twin)."""
    dtype = model.dtype
    for experts in moe_layers(model):
        if experts.weight_format is None:
            continue
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name).dequantize(dtype)
            delattr(experts, name)
            setattr(experts, name, torch.nn.Parameter(weight, requires_grad=False))


def _nbytes(experts) -> int:
    return weight_nbytes(experts.gate_up_proj) + weight_nbytes(experts.down_proj)
