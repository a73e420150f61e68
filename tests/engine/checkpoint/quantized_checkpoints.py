"""Writers of small pre-quantized checkpoints, in the layouts real ones use, and of their dequantized
twins (the same values as float tensors), from a float Locus model.

fbgemm_fp8 (Meta's Llama-4 FP8): every nn.Linear weight [out, in] E4M3 + weight_scale [out, 1] float32
unless modules_to_not_convert keeps it; fused experts gate_up_proj [E, H, 2I] E4M3 + gate_up_proj_scale
[E, 1, 2I], down_proj [E, I, H] E4M3 + down_proj_scale [E, H, 1] (one scale per output column).
mxfp4 (gpt-oss's layout on Llama-4's names): experts as {gate_up,down}_proj_blocks [E, N, K/32, 16] uint8
and _scales [E, N, K/32] uint8 (E8M0), [out, in] with blocks along `in`; everything else float.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import save_file

from locus.engine.checkpoint.quantized import CheckpointQuantization
from locus.engine.checkpoint.weights import checkpoint_tensors
from locus.kernels.formats import quantize

EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
LINEAR = re.compile(r"^(.*(?:_proj|router|lm_head))\.weight$")


def write_quantized(model, source: Path, out: Path, method: str, keep: list[str] | None = None,
                    prefix: str = "") -> tuple[Path, Path]:
    """Write `model` (loaded from the float checkpoint `source`, whose config.json and tokenizer files
    are copied) as a `method` checkpoint at out/"q" and its dequantized twin at out/"twin"."""
    rule = CheckpointQuantization(method, tuple(keep if keep is not None else ["lm_head"]))
    quantized, twin = {}, {}
    for name, tensor in checkpoint_tensors(model).items():
        tensor = tensor.float()
        experts, linear = EXPERTS.match(name), LINEAR.match(name)
        if experts and rule.converts(experts.group(1)):
            if method == "fbgemm_fp8":
                q = quantize(tensor, "fp8", axis=1)  # [E, K, N], a scale per output column: [E, 1, N]
                quantized[name] = q.data
                quantized[name + "_scale"] = q.scale if experts.group(2) == "gate_up_proj" else q.scale.transpose(1, 2)
            else:
                q = quantize(tensor.transpose(1, 2).contiguous(), "mxfp4", axis=-1)  # [E, N, K]: blocks along in
                E, N, K = q.shape
                quantized[name + "_blocks"] = q.data.reshape(E, N, K // 32, 16)
                quantized[name + "_scales"] = q.scale
                q = quantize(tensor, "mxfp4", axis=1)
            twin[name] = q.dequantize()
        elif linear and method == "fbgemm_fp8" and rule.converts(linear.group(1)):
            q = quantize(tensor, "fp8", axis=-1)
            quantized[name], quantized[name.removesuffix(".weight") + ".weight_scale"] = q.data, q.scale
            twin[name] = q.dequantize()
        else:
            quantized[name] = twin[name] = tensor
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = "float32"
    paths = []
    for kind, tensors in (("q", quantized), ("twin", twin)):
        path = out / kind
        path.mkdir(parents=True)
        save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
        body = dict(config)
        if kind == "q":
            body["quantization_config"] = {"quant_method": method, "activation_scale_ub": 1200.0,
                                           **({"modules_to_not_convert": keep} if keep is not None else {})}
        (path / "config.json").write_text(json.dumps(body, indent=2))
        for f in [*source.glob("tokenizer*.json"), *source.glob("special_tokens_map.json")]:
            shutil.copy(f, path / f.name)
        paths.append(path)
    return paths[0], paths[1]
