"""Which dot form multiplies narrow expert weights in the Triton fused MoE, per format, dtype and device.

The forms themselves are in moe_narrow.py (the Triton side); this module holds the choice and the
rules, and imports no Triton, so the engine can name the path at load time on any machine.

`choose_dot` picks "dequant" for every format on every device. Measured on an H200 (Triton 3.6,
Llama-4 Scout's expert shape; docs/kernels.md, "Narrow weights measured on the H200"), it was faster
at decode and prefill sizes than the forms the earlier rule picked there: "fp8" (W8A8 on FP8 tensor
cores) for prefill-sized fp8 batches and "scaled" (tl.dot_scaled) for mxfp8. `LOCUS_MOE_DOT=dequant|scaled|fp8`
overrides the choice (per call: `fused_moe_triton(..., dot=...)`) within `check_dot`'s rules: on
CUDA, "scaled" is refused for mxfp4 weights, whose tl.dot_scaled "e2m1" product was wrong on that
H200 (the form stays for the interpreter, where it matches the reference).
"""

from __future__ import annotations

import os

import torch

DOT_FORMS = ("dequant", "scaled", "fp8")
FORM_OF_FORMAT = {"fp8": ("dequant", "fp8"), "mxfp8": ("dequant", "scaled"), "mxfp4": ("dequant", "scaled")}
MIN_BLOCK_K = 32  # one E8M0 scale per 32 rows of K; an FP8 tensor-core dot takes K >= 32 too
FP8_CAPABILITY = (8, 9)  # Ada and Hopper: E4M3 tensor-core dots
# tl.dot_scaled: Triton lowers it from Ampere on; the form has been checked from Hopper on (an upcast
# to bf16 and a bf16 dot there), so the GPU tests run it from this capability.
SCALED_CAPABILITY = (9, 0)
DECODE_ROWS = 16  # rows an expert gets on average up to which a batch is weight-read bound (moe_configs)
MXFP4_SCALED_ON_CUDA = ("tl.dot_scaled with e2m1 weights was measured wrong on CUDA (an H200, Hopper, Triton 3.6: "
                        "max |diff| 0.71 at T=1 up to 3.7 at T=512 against the reference), so it is refused on "
                        "every CUDA device; use the 'dequant' dot form")


def choose_dot(fmt: str, dtype: torch.dtype, device: torch.device, rows_per_expert: float = 0.0) -> str:
    """The dot form for `fmt` weights with `dtype` activations on `device`, for a batch that gives
    each expert `rows_per_expert` rows on average: LOCUS_MOE_DOT if set, else "dequant" (the
    measured choice holds at every batch size, so `rows_per_expert` does not change it today)."""
    if fmt == "float":
        return "dequant"
    forced = os.environ.get("LOCUS_MOE_DOT")
    if forced:
        check_dot(forced, fmt, dtype, device)
        return forced
    return "dequant"


def check_dot(dot: str, fmt: str, dtype: torch.dtype, device: torch.device | None = None) -> None:
    """ValueError unless `dot` can multiply `fmt` weights with `dtype` activations (on `device`)."""
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
    if dot == "scaled" and fmt == "mxfp4" and device is not None and device.type == "cuda":
        raise ValueError(f"the 'scaled' dot form is refused for mxfp4 experts: {MXFP4_SCALED_ON_CUDA}")
