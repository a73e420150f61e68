"""Suite-wide set-up; keep this file minimal.

Without a GPU, Triton kernels run in Triton's interpreter. TRITON_INTERPRET is read when Triton itself
and each @triton.jit kernel is imported, and test modules import Triton indirectly (transformers does),
so it is set here, in the first conftest pytest loads, before any test module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
