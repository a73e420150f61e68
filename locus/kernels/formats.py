"""Narrow number formats: OCP MX v1.0 block formats and row-wise FP8. Imports nothing of ours.

Formats (`FORMATS`, by name):
    mxfp8        OCP MXFP8: E4M3 elements, one E8M0 scale per block of 32          8.25 bits an element
    mxfp8_e5m2   OCP MXFP8 with E5M2 elements                                        8.25
    mxfp4        OCP MXFP4: E2M1 elements, two a byte, one E8M0 scale per 32         4.25
    mxint8       OCP MXINT8: int8 elements read as int8 * 2^-6, E8M0 scale per 32    8.25
    fp8          row-wise FP8 (FBGEMM, Meta's Llama-4 FP8 checkpoints): E4M3 elements, one float32
                 scale per row (per output channel of a weight)                      8 + 32/row length

A value is `element * scale`. Every quantized tensor has one `axis`: the dimension its scales are
shared along (blocks of 32 consecutive entries for MX, the whole dimension for row-wise FP8), and for
MXFP4 also the dimension two values share a byte along (low nibble: the even index, as the spec's
examples, torchao and gpt-oss checkpoints pack along the last dimension).

MX quantization follows the spec's conversion (section 6.3): per block, the shared exponent is
`floor(log2(amax)) - emax_elem` clamped to E8M0's [-127, 127], the scale `X = 2^exp`, and each
element `round(v / X)` to nearest-even, saturating at the element format's largest normal value.
Special values:
    all-zero block         scale 2^-127 (byte 0), elements zero
    a NaN or Inf in block  scale NaN (byte 0xFF): the whole block reads back NaN (spec section 5.3;
                           as torchao does); elements zero
    a short last block     when the axis length n is not a multiple of 32, the last block holds
                           n % 32 elements and its scale is chosen from those alone
    odd n (MXFP4)          the last byte's high nibble is a zero pad
MXINT8 saturates symmetrically at +-127 (-128 is never produced, but reads back as -2).
Row-wise FP8: `scale = max(amax, ROW_MIN_AMAX) / 448` per row (float32), elements `round(v / scale)` to nearest-even, saturating at +-448; a row with a NaN
or Inf reads back NaN.

Storage (`QuantizedTensor`): `data` holds the elements in the tensor's logical shape, except that
MXFP4's axis is halved (rounded up) by packing; element dtypes are torch.float8_e4m3fn /
torch.float8_e5m2 (views of their bytes), torch.int8, or torch.uint8 for packed E2M1 (a
`torch.float4_e2m1fn_x2` view where the axis is the last dimension). MX `scale` holds the biased
E8M0 byte (uint8; `scale_e8m0()` is the torch.float8_e8m0fnu view) with the axis cut to ceil(n/32);
row-wise `scale` is float32 with the axis cut to 1. Everything runs on any device torch does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

BLOCK = 32  # elements per MX block (the spec's k)
E8M0_BIAS = 127
E8M0_NAN = 255
# Row-wise FP8: a row's amax is taken as at least this, so an all-zero row gets a finite, non-zero
# scale (FBGEMM's quantize_fp8_per_row clamps the same way).
ROW_MIN_AMAX = 1e-12


@dataclass(frozen=True)
class ElementFormat:
    """One element encoding. emax: the exponent of its largest normal value (the spec's emax_elem)."""

    name: str
    bits: int
    emax: int
    max_normal: float
    mbits: int  # mantissa bits (float formats); int8: the fraction bits of the implied 2^-6
    torch_dtype: torch.dtype  # how `data` is stored


E4M3 = ElementFormat("e4m3", 8, 8, 448.0, 3, torch.float8_e4m3fn)
E5M2 = ElementFormat("e5m2", 8, 15, 57344.0, 2, torch.float8_e5m2)
E2M1 = ElementFormat("e2m1", 4, 2, 6.0, 1, torch.uint8)
INT8 = ElementFormat("int8", 8, 0, 127 / 64, 6, torch.int8)


@dataclass(frozen=True)
class Format:
    """A quantized format: its element encoding and how scales are shared (block 32, or a whole row)."""

    name: str
    element: ElementFormat
    block: int | None  # None: one float32 scale per row (row-wise)

    @property
    def is_mx(self) -> bool:
        return self.block is not None

    def nbytes(self, n: int) -> int:
        """Bytes that one row of n elements takes along the axis: elements plus scales."""
        elements = (n + 1) // 2 if self.element.bits == 4 else n
        scales = -(-n // self.block) if self.is_mx else 4
        return elements + scales


FORMATS: dict[str, Format] = {
    "mxfp8": Format("mxfp8", E4M3, BLOCK),
    "mxfp8_e5m2": Format("mxfp8_e5m2", E5M2, BLOCK),
    "mxfp4": Format("mxfp4", E2M1, BLOCK),
    "mxint8": Format("mxint8", INT8, BLOCK),
    "fp8": Format("fp8", E4M3, None),
}

# E2M1 code (sign bit 3, exponent bits 2-1, mantissa bit 0) -> value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


# What an expert-parallel exchange can send its rows in (--ep-dispatch-format / --ep-combine-format):
# the model's own dtype, or an MX format with the scales along the hidden dimension.
PAYLOAD_FORMATS = ("model", "mxfp8", "mxint8")


def payload_row_bytes(n: int, fmt: str, model_bytes: int) -> int:
    """Bytes one exchanged row of n values takes: n * model_bytes in the model's dtype ("model"), else
    the MX format's elements and E8M0 scales (FORMATS[fmt].nbytes(n): n + ceil(n/32) for MXFP8)."""
    if fmt == "model":
        return n * model_bytes
    if fmt not in PAYLOAD_FORMATS:
        raise ValueError(f"unknown payload format {fmt!r}; choose one of {', '.join(PAYLOAD_FORMATS)}")
    return FORMATS[fmt].nbytes(n)


def get_format(name: str | Format) -> Format:
    if isinstance(name, Format):
        return name
    if name not in FORMATS:
        raise ValueError(f"unknown format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]


@dataclass
class QuantizedTensor:
    """A tensor in a narrow format: elements, scales, and the axis the scales are shared along.

    shape: the logical (dequantized) shape. For expert weights the layout is [E, K, N] with axis 1
    (K, the contraction dimension): data [E, K, N] (MXFP4: [E, ceil(K/2), N]), scale [E, ceil(K/32),
    N] (row-wise: [E, 1, N], one scale per output channel)."""

    data: torch.Tensor
    scale: torch.Tensor
    format: str
    shape: tuple[int, ...]
    axis: int

    @property
    def fmt(self) -> Format:
        return FORMATS[self.format]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: elements and scales."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> float:
        """Bytes per logical element, scales included (fractional: 1.03125 for MXFP8, 0.53125 for MXFP4)."""
        return self.nbytes / max(1, self.numel())

    def dim(self) -> int:
        return len(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self, dtype)

    def scale_e8m0(self) -> torch.Tensor:
        """MX scales as torch.float8_e8m0fnu (the same bytes)."""
        if not self.fmt.is_mx:
            raise ValueError(f"{self.format} has float32 scales, not E8M0")
        return self.scale.view(torch.float8_e8m0fnu)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return replace(self, data=self.data.to(device), scale=self.scale.to(device))

    def __getitem__(self, index) -> QuantizedTensor:
        """Entries of the first dimension (an int, a slice, a list or a tensor of indices); the axis
        must not be the first dimension. An int drops the dimension, as tensor indexing does."""
        if self.axis == 0:
            raise IndexError("cannot index a quantized tensor along its scale axis")
        if isinstance(index, int):
            return QuantizedTensor(self.data[index], self.scale[index], self.format, self.shape[1:], self.axis - 1)
        if isinstance(index, list):
            index = torch.tensor(index, dtype=torch.long)
        if isinstance(index, torch.Tensor):
            index = index.to(self.data.device)
        data, scale = self.data[index], self.scale[index]
        return QuantizedTensor(data, scale, self.format, (data.shape[0], *self.shape[1:]), self.axis)

    def detach(self) -> QuantizedTensor:
        return self

    def clone(self) -> QuantizedTensor:
        return replace(self, data=self.data.clone(), scale=self.scale.clone())

    def contiguous(self) -> QuantizedTensor:
        return replace(self, data=self.data.contiguous(), scale=self.scale.contiguous())


def quantize(x: torch.Tensor, fmt: str | Format, axis: int = -1) -> QuantizedTensor:
    """x (float32, bfloat16, float16 or float64) in `fmt`, scales shared along `axis`."""
    fmt = get_format(fmt)
    if not x.is_floating_point():
        raise TypeError(f"quantize takes a floating-point tensor, not {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize needs at least one dimension")
    axis = axis % x.dim()
    n = x.shape[axis]
    if n == 0:
        raise ValueError(f"cannot quantize along an empty axis (shape {tuple(x.shape)})")
    rows = x.float().movedim(axis, -1)  # [..., n]
    if fmt.is_mx:
        data, scale = _quantize_mx(rows, fmt)
    else:
        data, scale = _quantize_rowwise(rows, fmt)
    return QuantizedTensor(data.movedim(-1, axis).contiguous(), scale.movedim(-1, axis).contiguous(), fmt.name,
                           tuple(x.shape), axis)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values q stands for, computed in float32 (exact for every MX format), returned in dtype.
    Works in q's own layout (no transposition): the scales are broadcast along the axis."""
    fmt, axis = q.fmt, q.axis
    n = q.shape[axis]
    values = decode_elements(q.data, fmt.element, n, axis)  # q.shape, float32
    if not fmt.is_mx:
        return (values * q.scale.float()).to(dtype)
    nb = q.scale.shape[axis]
    if nb * fmt.block != n:  # a short last block: pad to whole blocks, multiply, cut
        pad = [0, 0] * (values.dim() - 1 - axis) + [0, nb * fmt.block - n]
        values = torch.nn.functional.pad(values, pad)
    blocks = values.unflatten(axis, (nb, fmt.block)) * e8m0_to_float(q.scale).unsqueeze(axis + 1)
    return blocks.flatten(axis, axis + 1).narrow(axis, 0, n).to(dtype)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 bytes -> float32 powers of two (2^-127 is a float32 subnormal; 0xFF is NaN)."""
    exponent = scale.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    return torch.where(scale.to(torch.int32) == E8M0_NAN, torch.full_like(out, float("nan")), out)


def decode_elements(data: torch.Tensor, element: ElementFormat, n: int, axis: int = -1) -> torch.Tensor:
    """Stored elements -> float32 element values, n of them along `axis` (E2M1 unpacked along it)."""
    if element is E2M1:
        axis = axis % data.dim()
        table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=data.device)
        codes = torch.stack([data & 0x0F, data >> 4], dim=axis + 1).flatten(axis, axis + 1).narrow(axis, 0, n)
        return torch.take(table, codes.long())
    if element is INT8:
        return data.float() * 2.0**-6
    if element is E4M3:  # through float16 (vectorised conversion; torch's float8 one is per element)
        bits = (data.view(torch.int8).to(torch.int16) << 7) & ~(1 << 14)  # float16 of value / 2^8
        nan = (data.view(torch.uint8) & 0x7F) == 0x7F
        return (bits.view(torch.float16).float() * 256.0).masked_fill_(nan, float("nan"))
    return data.float()


def _quantize_mx(rows: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., n] float32 -> elements [..., n] (packed for E2M1) and E8M0 bytes [..., ceil(n/32)]."""
    n, B = rows.shape[-1], fmt.block
    nb = -(-n // B)
    blocks = torch.nn.functional.pad(rows, (0, nb * B - n)).unflatten(-1, (nb, B))  # zero pad: amax unchanged
    amax = blocks.abs().amax(dim=-1)  # [..., nb]; NaN if the block has one
    special = ~torch.isfinite(amax)
    # floor(log2(amax)) from frexp (amax = m * 2^e, m in [0.5, 1)); zero blocks take the smallest scale
    _, e = torch.frexp(torch.where(special | (amax == 0), torch.ones_like(amax), amax))
    shared = torch.where(amax == 0, -E8M0_BIAS, e - 1 - fmt.element.emax).clamp(-E8M0_BIAS, E8M0_BIAS)
    scale = torch.where(special, E8M0_NAN, shared + E8M0_BIAS).to(torch.uint8)
    # v / X is exact in float32 (X is a power of two) unless it is below 2^-126, which rounds to zero
    # in every element format anyway
    scaled = torch.ldexp(blocks, -shared.unsqueeze(-1).to(torch.int32))
    scaled = torch.where(special.unsqueeze(-1), torch.zeros_like(scaled), scaled)
    data = encode_elements(scaled.flatten(-2)[..., :n], fmt.element)
    return data, scale


def _quantize_rowwise(rows: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    amax = rows.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp(min=ROW_MIN_AMAX) / fmt.element.max_normal  # NaN / Inf rows keep a NaN / Inf scale
    scaled = rows / scale
    scaled = torch.where(torch.isfinite(scale), scaled, torch.zeros_like(scaled))
    scale = torch.where(torch.isfinite(scale), scale, torch.full_like(scale, float("nan")))
    return encode_elements(scaled, fmt.element), scale


def encode_elements(v: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    """float32 values (already divided by their scale) -> stored elements, round-to-nearest-even,
    saturating at +-max_normal. E2M1 comes back packed two a byte along the last dimension."""
    v = v.clamp(-element.max_normal, element.max_normal)
    if element is INT8:
        return torch.round(v * 64).to(torch.int8)  # torch.round: half to even
    if element is E2M1:
        return _pack_nibbles(_e2m1_codes(v))
    return v.to(element.torch_dtype)  # torch's float8 casts round to nearest-even


def round_to_float_grid(v: torch.Tensor, element: ElementFormat) -> torch.Tensor:
    """v rounded to the nearest value of a float element format (ties to even), in v's dtype; no
    saturation. The step at v is 2^(max(floor(log2|v|), emin) - mbits)."""
    ebits = {E4M3.name: 4, E5M2.name: 5, E2M1.name: 2}[element.name]
    emin = 2 - 2 ** (ebits - 1)  # 1 - bias
    _, e = torch.frexp(torch.where(v == 0, torch.ones_like(v), v))
    step = torch.ldexp(torch.ones_like(v), (e - 1).clamp(min=emin) - element.mbits)
    return torch.round(v / step) * step


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Saturated float32 values -> 4-bit E2M1 codes (uint8). Magnitudes 0, .5, 1, 1.5 | 2, 3 | 4, 6
    are codes 2m | m + 2 | m / 2 + 4."""
    m = round_to_float_grid(v.abs(), E2M1)
    code = torch.where(m < 2, m * 2, torch.where(m < 4, m + 2, m / 2 + 4)).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] 4-bit codes -> [..., ceil(n/2)] bytes, element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)
