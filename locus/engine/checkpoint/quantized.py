"""Pre-quantized checkpoints: Meta's FBGEMM row-wise FP8 layout and gpt-oss-style MXFP4 experts.

config.json's `quantization_config` (top level, or in `text_config`) says which:

`quant_method: "fbgemm_fp8"` (Llama-4 Maverick's published FP8 checkpoint; what transformers'
FbgemmFp8Llama4TextExperts / FbgemmFp8Linear read). Every nn.Linear and every fused experts module
is FP8 unless `modules_to_not_convert` names it (transformers' matching: a pattern matches a module
name from its start up to a dot boundary, as a regex with the same boundary, or as a suffix; without
the list, only lm_head is kept). Converted tensors, E4M3 with float32 scales:
    ...{q,k,v,o}_proj, router, shared_expert.*, dense *_proj, lm_head
        weight        [out, in] E4M3          weight_scale       [out, 1]    w = weight * scale[row]
    ...feed_forward.experts
        gate_up_proj  [E, H, 2I] E4M3         gate_up_proj_scale [E, 1, 2I]  per output column
        down_proj     [E, I, H] E4M3          down_proj_scale    [E, H, 1]   per output column (note
                                                                             the transposed shape)
The experts stay FP8 (row-wise `fp8` QuantizedTensors, scale [E, 1, N]) on every MoE backend (the
cpu and Triton kernels read them narrow, torch dequantizes per call); the linear layers are
dequantized at load to the compute dtype (logged).

`quant_method: "mxfp4"` (gpt-oss's layout, on Llama-4's expert names): the fused experts as
    gate_up_proj_blocks [E, 2I, H/32, 16] uint8 (E2M1, two a byte, the even element low)
    gate_up_proj_scales [E, 2I, H/32] uint8 (E8M0)          and down_proj_{blocks,scales} likewise
i.e. [out, in] blocks along `in`; held as `mxfp4` QuantizedTensors in Locus's [E, K, N] layout.
Everything else is a float tensor.

Anything else is refused with one LocusError naming the field or tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from locus.errors import LocusError
from locus.kernels.formats import QuantizedTensor

METHODS = ("fbgemm_fp8", "mxfp4")
PREFIX = "language_model."  # the multimodal checkpoints' names (and their modules_to_not_convert)


@dataclass(frozen=True)
class CheckpointQuantization:
    method: str
    keep: tuple[str, ...]  # modules_to_not_convert patterns

    def converts(self, module: str) -> bool:
        """Whether the checkpoint holds `module` (canonical name, e.g. model.layers.0.self_attn.q_proj)
        quantized: transformers' should_convert_module rule, tried on the name with and without the
        multimodal prefix."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        for name in (module, PREFIX + module):
            for key in self.keep:
                if name.endswith(key) or re.match(rf"(?:{key}){boundary}", name):
                    return False
        return True


def read_quantization(model_dir: Path) -> CheckpointQuantization | None:
    """The checkpoint's quantization_config, checked; None for a float checkpoint."""
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    config = raw.get("quantization_config")
    if config is None and isinstance(raw.get("text_config"), dict):
        config = raw["text_config"].get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise LocusError(f"{path}: quantization_config must be an object")
    method = config.get("quant_method")
    if method not in METHODS:
        raise LocusError(f"{path}: quantization_config.quant_method {method!r} is not supported "
                         f"(Locus reads {', '.join(METHODS)})")
    keep = config.get("modules_to_not_convert")
    if keep is None:
        keep = ["lm_head"]  # transformers' default: the output embedding stays in full precision
    if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
        raise LocusError(f"{path}: quantization_config.modules_to_not_convert must be a list of module names")
    for key in keep:
        try:
            re.compile(key)
        except re.error as exc:
            raise LocusError(f"{path}: quantization_config.modules_to_not_convert entry {key!r} is not a valid "
                             f"pattern ({exc})") from None
    return CheckpointQuantization(method, tuple(keep))


def linear_weights(model) -> list[str]:
    """Parameter names of the model's nn.Linear weights (what fbgemm_fp8 converts)."""
    return [f"{name}.weight" for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def quantized_linears(model, quant: CheckpointQuantization | None) -> set[str]:
    if quant is None or quant.method != "fbgemm_fp8":
        return set()
    return {name for name in linear_weights(model) if quant.converts(name.removesuffix(".weight"))}


def quantized_experts(model, quant: CheckpointQuantization | None) -> dict[str, torch.nn.Module]:
    """Canonical module name -> the `Experts` module of each MoE layer the checkpoint quantizes."""
    if quant is None:
        return {}
    out = {}
    for layer in model.config.moe_layers:
        name = f"model.layers.{layer}.feed_forward.experts"
        if quant.converts(name):
            out[name] = model.get_submodule(name)
    return out


def read_fp8_linear(name: str, shape: tuple[int, ...], found: dict, reader, used: set[str],
                    dtype: torch.dtype) -> torch.Tensor:
    """An FBGEMM FP8 linear weight [out, in] dequantized to dtype: weight * weight_scale[row]."""
    weight = _take(name, found, reader, used, "the FP8 weight")
    scale = _take(name + "_scale", found, reader, used, f"the scale of {name!r} (fbgemm_fp8 converts its module)")
    _expect(name, weight, shape, torch.float8_e4m3fn)
    _expect(name + "_scale", scale, (shape[0], 1), torch.float32)
    return (weight.float() * scale).to(dtype)


def read_experts(base: str, num_experts: int, rows: list[int], H: int, I: int, quant: CheckpointQuantization,
                 found: dict, reader, used: set[str]) -> tuple[QuantizedTensor, QuantizedTensor]:
    """The rows `rows` of a layer's quantized experts `base` as (gate_up, down) in Locus's layout."""
    if quant.method == "fbgemm_fp8":
        return (_fp8_experts(f"{base}.gate_up_proj", (num_experts, H, 2 * I), (num_experts, 1, 2 * I), rows, found,
                             reader, used),
                _fp8_experts(f"{base}.down_proj", (num_experts, I, H), (num_experts, H, 1), rows, found, reader, used))
    return (_mxfp4_experts(f"{base}.gate_up_proj", num_experts, H, 2 * I, rows, found, reader, used),
            _mxfp4_experts(f"{base}.down_proj", num_experts, I, H, rows, found, reader, used))


def _fp8_experts(name, shape, scale_shape, rows, found, reader, used) -> QuantizedTensor:
    E, K, N = shape
    data = _take_rows(name, shape, rows, found, reader, used, "the FP8 expert weights")
    scale = _take_rows(name + "_scale", scale_shape, rows, found, reader, used,
                       f"the scale of {name!r} (fbgemm_fp8 converts its module)")
    _expect(name, data, (len(rows), K, N), torch.float8_e4m3fn)
    _expect(name + "_scale", scale, (len(rows), *scale_shape[1:]), torch.float32)
    return QuantizedTensor(data.contiguous(), scale.reshape(len(rows), 1, N).contiguous(), "fp8", (len(rows), K, N), 1)


def _mxfp4_experts(name, E, K, N, rows, found, reader, used) -> QuantizedTensor:
    if K % 32:
        raise LocusError(f"tensor {name + '_blocks'!r}: mxfp4 checkpoints need the input size ({K}) to be a "
                         f"multiple of 32")
    blocks = _take_rows(name + "_blocks", (E, N, K // 32, 16), rows, found, reader, used, "the MXFP4 blocks")
    scales = _take_rows(name + "_scales", (E, N, K // 32), rows, found, reader, used,
                        f"the E8M0 scales of {name + '_blocks'!r}")
    _expect(name + "_blocks", blocks, (len(rows), N, K // 32, 16), torch.uint8)
    _expect(name + "_scales", scales, (len(rows), N, K // 32), torch.uint8)
    data = blocks.reshape(len(rows), N, K // 2).transpose(1, 2).contiguous()  # [S, K/2, N], packed along K
    return QuantizedTensor(data, scales.transpose(1, 2).contiguous(), "mxfp4", (len(rows), K, N), 1)


def _take(name, found, reader, used, what) -> torch.Tensor:
    if name not in found:
        raise LocusError(f"checkpoint is missing tensor {name!r} ({what})")
    used.add(name)
    return reader.get(*found[name])


def _take_rows(name, full_shape, rows, found, reader, used, what) -> torch.Tensor:
    if name not in found:
        raise LocusError(f"checkpoint is missing tensor {name!r} ({what})")
    used.add(name)
    return reader.get_rows(*found[name], rows, full_shape)


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise LocusError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    if tensor.dtype != dtype:
        raise LocusError(f"tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}, expected "
                         f"{str(dtype).removeprefix('torch.')}")
