"""The greedy token of each sequence from logits laid out [V, B] (argmax_cpu.c), and the custom op
`locus::vocab_argmax` that puts it into the compiled decode graph.

The compiled CPU decode step computes its logits as `W @ h^T`, [V, B], the lm_head form that reads
the weight once. Taking each column's argmax there costs 0.3 ms in inductor's generated reduction and
0.5-1.7 ms in aten at V = 32000, B = 32; the C sweep takes about 0.1 ms (2 threads; docs/kernels.md). Same result as `logits.argmax(0)`: the
first index of the maximum, a NaN above any number.

Build: c_library.py. Without a compiler, other dtypes, or a layout whose columns are not adjacent,
the op is `torch.argmax`.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from locus.kernels import c_library

SOURCE = Path(__file__).with_name("argmax_cpu.c")
KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.cache
def load_library() -> ctypes.CDLL | None:
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return c_library.build(SOURCE, "the cpu argmax kernel", "using torch.argmax",
                           {f"locus_argmax_{suffix}": ([ptr, i64, i64, i64, ptr, i32], None)
                            for suffix in KERNEL_DTYPES.values()})


def kernel_applies(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in KERNEL_DTYPES
            and logits.shape[0] > 0 and logits.stride(1) == 1 and load_library() is not None)


@torch.library.custom_op("locus::vocab_argmax", mutates_args=())
def vocab_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [V, B] -> [B] int64, each column's argmax (= logits.argmax(0))."""
    if not kernel_applies(logits):
        return logits.argmax(0)
    V, B = logits.shape
    out = torch.empty(B, dtype=torch.int64)
    getattr(load_library(), f"locus_argmax_{KERNEL_DTYPES[logits.dtype]}")(
        logits.data_ptr(), V, B, logits.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


@vocab_argmax.register_fake
def _(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[1], dtype=torch.int64)
