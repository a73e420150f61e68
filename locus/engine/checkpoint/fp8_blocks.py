"""DeepSeek-V3's FP8 checkpoints: block-scaled E4M3 weights, dequantized at load.

config.json says `quantization_config: {quant_method: "fp8", weight_block_size: [128, 128],
activation_scheme: "dynamic"}` (deepseek_config.py refuses any other). Each converted linear weight
`W` [out, in] is stored as float8_e4m3fn beside `W_scale_inv` [ceil(out/128), ceil(in/128)] float32,
and the real weight is `W[i, j] * scale_inv[i // 128, j // 128]` (the last blocks may be partial).
Which modules are converted is read from the file itself (an E4M3 tensor with a scale), so the
checkpoint's `modules_to_not_convert` needs no reading; an E4M3 tensor without its scale, or a scale
whose shape does not tile its weight, is one error naming the tensor. Locus holds the dequantized
weights in the compute dtype (the experts may be narrowed again with --quantize-experts).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from locus.errors import LocusError

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"


def is_block_fp8(model_dir: Path) -> bool:
    """Whether config.json declares DeepSeek's block-scaled FP8 (its values are checked by the config)."""
    raw = json.loads((model_dir / "config.json").read_text())
    quant = raw.get("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "fp8"


def take_scales(found: dict[str, tuple[Path, str]]) -> dict[str, tuple[Path, str]]:
    """Remove the `*_scale_inv` tensors from `found`; return them keyed by their weight's name in the file."""
    scales = {}
    for canonical in [n for n in found if n.endswith(SCALE_SUFFIX)]:
        shard, name = found.pop(canonical)
        scales[name[: -len(SCALE_SUFFIX)]] = (shard, name)
    return scales


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.Tensor:
    """weight [out, in] E4M3, scale_inv [ceil(out/128), ceil(in/128)] -> float32 [out, in]."""
    if weight.dim() != 2:
        raise LocusError(f"tensor {name!r}: a block-scaled FP8 weight must be 2-D, got shape {tuple(weight.shape)}")
    out, inp = weight.shape
    expected = (-(-out // BLOCK), -(-inp // BLOCK))
    if tuple(scale_inv.shape) != expected:
        raise LocusError(f"tensor {name}{SCALE_SUFFIX!s} has shape {tuple(scale_inv.shape)}; {name!r} "
                         f"{tuple(weight.shape)} in {BLOCK}x{BLOCK} blocks needs {expected}")
    scale = scale_inv.float().repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :inp]
    return weight.float() * scale


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (E4M3 [out, in], scale_inv float32 [ceil(out/128), ceil(in/128)]): each block
    scaled so its largest magnitude is E4M3's 448 (how the tests write an FP8 twin of a float checkpoint)."""
    out, inp = weight.shape
    rows, cols = -(-out // BLOCK), -(-inp // BLOCK)
    padded = torch.zeros(rows * BLOCK, cols * BLOCK, dtype=torch.float32)
    padded[:out, :inp] = weight.float()
    blocks = padded.view(rows, BLOCK, cols, BLOCK)
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale_inv[:, None, :, None]).view(rows * BLOCK, cols * BLOCK)[:out, :inp]
    return q.to(torch.float8_e4m3fn), scale_inv


class BlockFp8Reader:
    """Wraps the loader's shard reader: an E4M3 tensor comes back dequantized with its scale."""

    def __init__(self, reader, scales: dict[str, tuple[Path, str]]):
        self.reader, self.scales = reader, scales
        self.used: set[str] = set()

    def get(self, shard: Path, name: str) -> torch.Tensor:
        tensor = self.reader.get(shard, name)
        if tensor.dtype != torch.float8_e4m3fn:
            return tensor
        if name not in self.scales:
            raise LocusError(f"{shard}: tensor {name!r} is float8_e4m3fn without its {name}{SCALE_SUFFIX}")
        self.used.add(name)
        return dequantize_blocks(tensor, self.reader.get(*self.scales[name]), name)

    def get_rows(self, shard: Path, name: str, rows: list[int], full_shape: tuple[int, ...]) -> torch.Tensor:
        tensor = self.reader.get_rows(shard, name, rows, full_shape)
        if tensor.element_size() == 1:
            raise LocusError(f"{shard}: tensor {name!r}: block-scaled FP8 experts are read one by one "
                             "(mlp.experts.J.*.weight), not fused")
        return tensor

    def unused_scales(self) -> list[str]:
        return sorted(self.scales[n][1] for n in set(self.scales) - self.used)
