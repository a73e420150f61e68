"""Narrow expert weights in the Triton grouped GEMMs: reading one weight tile per format, and the dot.

The expert weights of moe_quantized.py ([E, K, N], scales along K) are read as they are stored, so
a decode step moves ~2x (fp8, mxfp8) or ~4x (mxfp4) fewer weight bytes than bfloat16; the kernels
widen each tile in registers inside their K loop. Three ways to multiply a tile (`DOT_FORMS`):

  "dequant"  portable (every device, the interpreter, float32 activations): the tile is widened to
             float32, multiplied by its scales (E8M0 per 32 rows of K for MX; row-wise FP8's
             per-column scale is applied once to the accumulator after the loop, since it is constant
             along K), cast to x's dtype and multiplied with the ordinary tl.dot. Every MX weight
             times its power-of-two scale is exact in bfloat16, so this is the reference's math up
             to summation order (row-wise FP8 skips the reference's rounding of weight * scale).
  "scaled"   mxfp8 / mxfp4 with 16-bit activations: tl.dot_scaled(x, None, "bf16", w, scale, "e4m3"
             or "e2m1"), the MX tile handed to Triton as stored (E2M1 packed along K, scales [N, K/32]).
             Triton lowers it to block-scaled tensor-core instructions where the GPU has them
             (Blackwell) and otherwise, Hopper included, to its own upcast to bfloat16 and a bf16
             dot: the same math as "dequant", with Triton's conversion and layouts. The mxfp4
             ("e2m1") product is refused on CUDA: it was wrong on an H200 with Triton 3.6
             (moe_dot_forms.py); the interpreter runs it.
  "fp8"      W8A8 for row-wise fp8 weights on GPUs with FP8 tensor cores (compute capability 8.9+):
             each GEMM's activations (x, then h) are quantized once to E4M3 with one float32 scale
             per row (`quantize_activations`: FBGEMM's quantize_fp8_per_row, which is how Meta's
             FP8 Llama-4 experts run in transformers), the kernels multiply E4M3 x E4M3, and both
             scales (the activation row's, the weight column's) are applied after the K loop.
             It adds the activations' E4M3 rounding (up to 2^-4 relative per element) to the weights'.
             Quantizing the tile inside the kernel instead would repeat the work in every N tile
             and cost about as many CUDA-core cycles as the FP8 product saves.
             MXFP8 has no fp8 form: its scale changes every 32 rows of K along every column, so
             each 32-row step would need a product and a promotion of its own.

Which form runs where: moe_dot_forms.py. A fast form that fails to build falls back to "dequant"
with a warning (moe_triton.py). Shape legend: R rows, K contraction rows, N columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from locus.kernels.formats import QuantizedTensor, quantize
from locus.kernels.moe_dot_forms import FORM_OF_FORMAT, FP8_CAPABILITY


@dataclass(frozen=True)
class WeightOperand:
    """One GEMM's expert weight as the kernels read it: logical [E, K, N], data, scales, strides."""

    data: torch.Tensor
    scale: torch.Tensor  # the data itself for float weights (never read)
    format: str  # "float", "fp8", "mxfp8", "mxfp4"
    shape: tuple[int, int, int]

    @property
    def strides(self) -> tuple[int, int, int]:
        return tuple(self.data.stride())

    @property
    def scale_strides(self) -> tuple[int, int, int]:
        return tuple(self.scale.stride()) if self.format != "float" else (0, 0, 0)


def weight_operand(w: torch.Tensor | QuantizedTensor) -> WeightOperand:
    """E4M3 and E2M1 data go to the kernels as their bytes (uint8): GPUs without FP8 support
    (before sm_89) refuse float8 tensors even where a kernel only moves and widens them."""
    if isinstance(w, QuantizedTensor):
        if w.format not in FORM_OF_FORMAT or w.dim() != 3 or w.axis != 1:
            raise ValueError(f"the Triton kernels read {', '.join(FORM_OF_FORMAT)} expert weights [E, K, N] with "
                             f"scales along K (got {w.format}, shape {w.shape}, axis {w.axis})")
        return WeightOperand(w.data.view(torch.uint8), w.scale, w.format, tuple(w.shape))
    if w.dim() != 3:
        raise ValueError(f"expert weights must be 3-D [E, K, N], got {tuple(w.shape)}")
    return WeightOperand(w, w, "float", tuple(w.shape))


def weight_format(w: torch.Tensor | QuantizedTensor) -> str:
    return w.format if isinstance(w, QuantizedTensor) else "float"


@triton.jit
def e8m0_to_float(s):
    """E8M0 bytes -> float32 2^(s - 127); byte 0 is 2^-127 (a subnormal), byte 255 NaN."""
    bits = s.to(tl.int32) << 23
    bits = tl.where(s == 0, 0x00400000, bits)
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


def fp8_native(device: torch.device) -> bool:
    """Whether Triton converts E4M3 in hardware here (sm_89+, and the interpreter); elsewhere the
    kernels decode the bits themselves."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


@triton.jit
def e4m3_to_float(b, NATIVE: tl.constexpr):
    """E4M3 bytes (uint8) -> float32. NATIVE: the hardware conversion. Otherwise the sign, exponent and
    mantissa bits land in a float16's fields, which reads them as the value times 2^-8 (subnormals
    too); 0x7F / 0xFF are NaN."""
    if NATIVE:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        bits = ((b & 0x80).to(tl.uint16) << 8) | ((b & 0x7F).to(tl.uint16) << 7)
        bits = tl.where((b & 0x7F) == 0x7F, 0x7E00, bits)  # a float16 NaN
        return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def e2m1_to_float(code):
    """4-bit E2M1 codes (uint8) -> float32, exactly: the exponent and mantissa bits land in a float16's
    fields, which reads them as the value times 2^-14 (0.5 as a subnormal too)."""
    bits = ((code & 7).to(tl.uint16) << 9) | ((code & 8).to(tl.uint16) << 12)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _scale_blocks(w, s, ROWS: tl.constexpr):
    """w [R, BN] float32 times s [R / ROWS, BN]: each scale row covers ROWS consecutive rows of w."""
    return tl.reshape(tl.reshape(w, (w.shape[0] // ROWS, ROWS, w.shape[1])) * s[:, None, :], (w.shape[0], w.shape[1]))


@triton.jit
def load_weight_tile(w_ptr, s_ptr, k, k_stop, offs_n, n_ok, stride_wk, stride_wn, stride_sk, stride_sn,
                     FORMAT: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, FP8_NATIVE: tl.constexpr):
    """Rows k .. k + BLOCK_K of one expert's weight (rows from k_stop on read as 0) as a [BLOCK_K, BN]
    tile in DTYPE. Row-wise fp8 comes back without its column scale (see `apply_scales`)."""
    offs_k = k + tl.arange(0, BLOCK_K)
    if FORMAT == "float":
        ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        return tl.load(ptrs, mask=(offs_k < k_stop)[:, None] & n_ok[None, :], other=0.0).to(DTYPE)
    elif FORMAT == "fp8":
        ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        w = tl.load(ptrs, mask=(offs_k < k_stop)[:, None] & n_ok[None, :], other=0)
        return e4m3_to_float(w, FP8_NATIVE).to(DTYPE)
    else:
        blocks = k // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(s_ptr + blocks[:, None] * stride_sk + offs_n[None, :] * stride_sn,
                    mask=(blocks * 32 < k_stop)[:, None] & n_ok[None, :], other=127)
        scale = e8m0_to_float(s)  # [BLOCK_K / 32, BN]
        if FORMAT == "mxfp8":
            ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
            w = tl.load(ptrs, mask=(offs_k < k_stop)[:, None] & n_ok[None, :], other=0)
            return _scale_blocks(e4m3_to_float(w, FP8_NATIVE), scale, 32).to(DTYPE)
        else:  # mxfp4: byte row j holds rows 2j (low nibble) and 2j + 1 (high)
            rows = k // 2 + tl.arange(0, BLOCK_K // 2)
            ptrs = w_ptr + rows[:, None] * stride_wk + offs_n[None, :] * stride_wn
            packed = tl.load(ptrs, mask=(2 * rows < k_stop)[:, None] & n_ok[None, :], other=0)
            lo = _scale_blocks(e2m1_to_float(packed & 15), scale, 16)
            hi = _scale_blocks(e2m1_to_float(packed >> 4), scale, 16)
            return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, lo.shape[1])).to(DTYPE)


@triton.jit
def dot_scaled_tile(acc, a, w_ptr, s_ptr, k, k_stop, offs_n, n_ok, stride_wk, stride_wn, stride_sk, stride_sn,
                    FORMAT: tl.constexpr, LHS_FORMAT: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a @ (rows k .. k + BLOCK_K of an MX weight), through tl.dot_scaled on the stored tile."""
    blocks = k // 32 + tl.arange(0, BLOCK_K // 32)
    scale = tl.load(s_ptr + blocks[None, :] * stride_sk + offs_n[:, None] * stride_sn,
                    mask=(blocks * 32 < k_stop)[None, :] & n_ok[:, None], other=127)  # [BN, BLOCK_K / 32]
    if FORMAT == "mxfp4":
        rows = k // 2 + tl.arange(0, BLOCK_K // 2)
        ptrs = w_ptr + rows[:, None] * stride_wk + offs_n[None, :] * stride_wn
        w = tl.load(ptrs, mask=(2 * rows < k_stop)[:, None] & n_ok[None, :], other=0)
        return tl.dot_scaled(a, None, LHS_FORMAT, w, scale, "e2m1", acc)
    else:
        offs_k = k + tl.arange(0, BLOCK_K)
        ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        w = tl.load(ptrs, mask=(offs_k < k_stop)[:, None] & n_ok[None, :], other=0)  # E4M3 bytes
        return tl.dot_scaled(a, None, LHS_FORMAT, w, scale, "e4m3", acc)


def quantize_activations(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The "fp8" form's left operand: a [R, C] as E4M3 [R, C] with one float32 scale per row [R]
    (row-wise fp8, FBGEMM's quantize_fp8_per_row rule), computed once per GEMM, not per program."""
    q = quantize(a, "fp8", axis=1)
    return q.data, q.scale.reshape(-1)


@triton.jit
def dot_fp8_tile(acc, a_q, w_ptr, k, k_stop, offs_n, n_ok, stride_wk, stride_wn, BLOCK_K: tl.constexpr):
    """acc + a_q (E4M3) @ rows k .. k + BLOCK_K of an E4M3 weight on FP8 tensor cores; the partial
    products are promoted to the fp32 accumulator every BLOCK_K rows (Hopper accumulates FP8
    products in less than fp32 precision otherwise)."""
    offs_k = k + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    w = tl.load(ptrs, mask=(offs_k < k_stop)[:, None] & n_ok[None, :], other=0)
    return tl.dot(a_q, w.to(tl.float8e4nv, bitcast=True), acc, max_num_imprecise_acc=BLOCK_K)


@triton.jit
def apply_scales(acc, s_ptr, offs_n, n_ok, stride_sn, as_ptr, a_rows, row_ok, FORMAT: tl.constexpr,
                 DOT: tl.constexpr):
    """After the K loop: row-wise fp8 weights' column scales and the "fp8" form's row scales of the
    quantized activations (as_ptr[a_rows]); other formats and forms leave acc as it is."""
    if FORMAT == "fp8":
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=1.0)[None, :]
    if DOT == "fp8":
        acc = acc * tl.load(as_ptr + a_rows, mask=row_ok, other=1.0)[:, None]
    return acc
