"""Which dot form multiplies narrow expert weights in the Triton fused MoE, per format, dtype and device.

The forms themselves are in moe_narrow.py (the Triton side); this module holds the choice and the
rules, and imports no Triton, so the engine can name the path at load time on any machine.

`choose_dot` picks the form: "scaled" (tl.dot_scaled) for mxfp8 / mxfp4 weights with 16-bit
activations on GPUs that lower it; for fp8 weights "fp8" (W8A8 on FP8 tensor cores) only on
prefill-sized batches (more than DECODE_ROWS rows an expert on average), where the tensor-core rate
decides; "dequant" everywhere else. A decode batch's time is the weight read, which "dequant"
already halves; the "fp8" form would add two quantize passes and the activations' rounding for no
gain there. `LOCUS_MOE_DOT=dequant|scaled|fp8` overrides the choice (per call:
`fused_moe_triton(..., dot=...)`).
"""

from __future__ import annotations

import os

import torch

DOT_FORMS = ("dequant", "scaled", "fp8")
FORM_OF_FORMAT = {"fp8": ("dequant", "fp8"), "mxfp8": ("dequant", "scaled"), "mxfp4": ("dequant", "scaled")}
MIN_BLOCK_K = 32  # one E8M0 scale per 32 rows of K; an FP8 tensor-core dot takes K >= 32 too
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: E4M3 tensor-core dots
# tl.dot_scaled: Triton lowers it from Ampere on, but the form is chosen where it has been checked
# (Hopper: an upcast to bf16 and a bf16 dot; Blackwell: block-scaled tensor cores); older GPUs
# take the portable form.
SCALED_CAPABILITY = (9, 0)
DECODE_ROWS = 16  # rows an expert gets on average up to which a batch is weight-read bound (moe_configs)


def choose_dot(fmt: str, dtype: torch.dtype, device: torch.device, rows_per_expert: float = 0.0) -> str:
    """The dot form for `fmt` weights with `dtype` activations on `device` ("dequant" for float
    weights): LOCUS_MOE_DOT if set, else the fastest form the device has for a batch that gives each
    expert `rows_per_expert` rows on average."""
    if fmt == "float":
        return "dequant"
    forced = os.environ.get("LOCUS_MOE_DOT")
    if forced:
        check_dot(forced, fmt, dtype)
        return forced
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "dequant"
    capability = torch.cuda.get_device_capability(device)
    if fmt == "fp8" and capability >= FP8_CAPABILITY and rows_per_expert > DECODE_ROWS:
        return "fp8"
    if fmt in ("mxfp8", "mxfp4") and capability >= SCALED_CAPABILITY:
        return "scaled"
    return "dequant"


def check_dot(dot: str, fmt: str, dtype: torch.dtype) -> None:
    """ValueError unless `dot` can multiply `fmt` weights with `dtype` activations."""
    if dot not in DOT_FORMS:
        raise ValueError(f"unknown dot form {dot!r}; choose one of {', '.join(DOT_FORMS)}")
    if fmt == "float":
        if dot != "dequant":
            raise ValueError(f"the {dot!r} dot form is for narrow expert weights; these are float")
        return
    if dot not in FORM_OF_FORMAT[fmt]:
        raise ValueError(f"{fmt} expert weights take the dot forms {', '.join(FORM_OF_FORMAT[fmt])}, not {dot!r}")
    if dot == "scaled" and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"tl.dot_scaled takes bfloat16 or float16 activations, not {dtype}")


