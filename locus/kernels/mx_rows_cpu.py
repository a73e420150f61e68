"""The expert-parallel payload codec on CPU (mx_rows_cpu.c): [N, H] rows in float32 / bfloat16 /
float16 <-> [N, H + ceil(H/32)] bytes, each row its H MX elements then its E8M0 scales (the packed
row of locus/engine/ep/payload.py), in one C pass per direction.

Bit-exact with the torch path (formats.py `quantize(x, fmt, axis=1)` + `torch.cat`, and
`QuantizedTensor.dequantize(dtype)`), NaN bytes included, for mxfp8 and mxint8, at a fraction of its
CPU time per call (docs/formats.md, "The codec on CPU"). `Payload` uses it for CPU tensors when
`encode_applies` / `decode_applies`; otherwise (a CUDA tensor, another format or dtype, no compiler,
inside torch.compile) it takes the torch path, which writes the same bytes.

Build: c_library.py.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from locus.kernels.formats import payload_row_bytes

SOURCE = Path(__file__).with_name("mx_rows_cpu.c")
FORMAT_CODES = {"mxfp8": 0, "mxint8": 1}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@functools.cache
def load_library() -> ctypes.CDLL | None:
    from locus.kernels import c_library

    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return c_library.build(SOURCE, "the cpu payload codec", "payloads are encoded with torch ops",
                           {"locus_mx_encode_rows": ([ptr, i64, i64, i32, i32, ptr], None),
                            "locus_mx_decode_rows": ([ptr, i64, i64, i64, i32, i32, i32, ptr], None)})


@functools.cache
def bfloat16_nan() -> int:
    """The bits torch's CPU float32 -> bfloat16 conversion gives a NaN (0xFFFF from its AVX2 / AVX-512
    path, 0x7FC0 from the scalar one), as the torch path's `.to(torch.bfloat16)` writes it."""
    rows = torch.full((2, 64), float("nan")).narrow(1, 0, 40)  # dequantize's [N, H] float32 as it converts it
    return int(rows.to(torch.bfloat16).view(torch.int16)[0, 0]) & 0xFFFF


def _applies(t: torch.Tensor, fmt: str, dtype: torch.dtype) -> bool:
    return (t.device.type == "cpu" and t.dim() == 2 and fmt in FORMAT_CODES and dtype in DTYPE_CODES
            and not torch.compiler.is_compiling() and load_library() is not None)


def encode_applies(x: torch.Tensor, fmt: str) -> bool:
    return _applies(x, fmt, x.dtype)


def decode_applies(rows: torch.Tensor, fmt: str, dtype: torch.dtype) -> bool:
    return _applies(rows, fmt, dtype) and rows.dtype == torch.uint8 and (rows.stride(1) == 1 or rows.shape[1] <= 1)


def encode_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """[N, H] -> [N, H + ceil(H/32)] uint8 (encode_applies(x, fmt) must hold)."""
    x = x.contiguous()
    N, H = x.shape
    out = torch.empty((N, payload_row_bytes(H, fmt, x.element_size())), dtype=torch.uint8)
    if N:
        load_library().locus_mx_encode_rows(x.data_ptr(), N, H, DTYPE_CODES[x.dtype], FORMAT_CODES[fmt],
                                            out.data_ptr())
    return out


def decode_rows(rows: torch.Tensor, fmt: str, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, >= H + ceil(H/32)] uint8, rows[i, j] at rows.stride(0) * i + j (a view into wider rows is
    fine) -> [N, H] in dtype (decode_applies(rows, fmt, dtype) must hold)."""
    N = rows.shape[0]
    if rows.shape[1] < payload_row_bytes(hidden, fmt, rows.element_size()):
        raise ValueError(f"rows of {rows.shape[1]} bytes hold no {fmt} row of {hidden} values")
    out = torch.empty((N, hidden), dtype=dtype)
    if N:
        load_library().locus_mx_decode_rows(rows.data_ptr(), N, hidden, rows.stride(0), DTYPE_CODES[dtype],
                                            FORMAT_CODES[fmt], bfloat16_nan(), out.data_ptr())
    return out
