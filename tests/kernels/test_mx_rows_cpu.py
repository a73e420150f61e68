"""The C payload codec (kernels/mx_rows_cpu.c) writes and reads exactly the bytes and values of the
torch path it replaces in Payload.encode / decode: same bits for every input, NaN included."""

import pytest
import torch

from locus.engine.ep import payload as payload_module
from locus.engine.ep.payload import Payload
from locus.kernels import mx_rows_cpu
from locus.kernels.formats import FORMATS, QuantizedTensor, quantize

pytestmark = pytest.mark.skipif(mx_rows_cpu.load_library() is None, reason="no C compiler")

FMTS = ("mxfp8", "mxint8")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def torch_encode(x, fmt):
    q = quantize(x, fmt, axis=1)
    return torch.cat([q.data.view(torch.uint8), q.scale], dim=1)


def torch_decode(rows, fmt, H, dtype):
    element = FORMATS[fmt].element.torch_dtype
    nbytes = H + -(-H // 32)
    q = QuantizedTensor(rows[:, :H].view(element), rows[:, H:nbytes], fmt, (rows.shape[0], H), 1)
    return q.dequantize(dtype)


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.uint8:
        mismatch = a != b
    else:
        mismatch = a.view(BITS[a.dtype]) != b.view(BITS[b.dtype])
    assert not mismatch.any(), f"{int(mismatch.sum())} differ, first at {mismatch.nonzero()[0].tolist()}"


def wide_rows(N, H, dtype, seed):
    """Random rows whose blocks' scales span the dtype's range: values of magnitude 2^[-150, 130] (as the
    dtype holds them: underflow to subnormals / zero, overflow to Inf), signs and mantissas random."""
    g = torch.Generator().manual_seed(seed)
    mantissa = torch.rand(N, H, generator=g, dtype=torch.float64) + 0.5
    sign = torch.where(torch.rand(N, H, generator=g) < 0.5, -1.0, 1.0).double()
    block_exp = torch.randint(-150, 131, (N, -(-H // 32)), generator=g).repeat_interleave(32, dim=1)[:, :H]
    spread = torch.randint(-12, 3, (N, H), generator=g)
    return (sign * mantissa * torch.exp2((block_exp + spread).double())).to(dtype)


def special_rows(dtype, fmt):
    """Rows of hand-picked values: zeros (both signs), NaN, +-Inf, values at and beyond max_normal,
    RNE ties (at the element format's half steps), element and dtype subnormals."""
    el = FORMATS[fmt].element
    H = 64
    rows = []
    z = torch.zeros(H)
    rows.append(z.clone())  # all zero
    rows.append(-z)  # all -0
    r = torch.zeros(H); r[3] = float("nan"); rows.append(r)
    r = torch.ones(H); r[40] = float("inf"); rows.append(r)
    r = torch.ones(H); r[0] = -float("inf"); r[33] = float("nan"); rows.append(r)
    # at and beyond max_normal with the block's amax pinning the scale at 1 (amax in [2^emax, 2^(emax+1)))
    top = 2.0 ** el.emax
    r = torch.tensor([top * 1.99, el.max_normal, -el.max_normal, el.max_normal * 1.01, -el.max_normal * 1.04]
                     + [0.0] * 27 + [1.0] * 32)
    rows.append(r)
    # ties: the block's scale is 1 (amax = top); half steps between element grid points
    if fmt == "mxfp8":
        ties = [1.0625, 1.1875, 1.3125, 0.5 + 1 / 32, 0.5 + 3 / 32, 2 ** -9 * 0.5, 2 ** -9 * 1.5, 2 ** -9 * 2.5,
                2 ** -7 + 2 ** -10, 17.0, 19.0, 21.0, 432.0 + 8, 464.0]
    else:
        ties = [k / 128 for k in (1, 3, 5, -1, -3, 7, 253, -253)]
    r = torch.tensor([top] + ties + [-t for t in ties])
    rows.append(torch.nn.functional.pad(r, (0, H - r.numel())))
    # dtype subnormals and tiny values beside a normal one and alone
    tiny = torch.finfo(dtype).tiny
    r = torch.tensor([tiny / 2, tiny / 4, -tiny / 8, tiny] * 8 + [tiny * 3] * 32)
    rows.append(r)
    # the largest finite values: the top scales
    big = torch.finfo(dtype).max
    r = torch.full((H,), big); r[1::2] = -big / 3; rows.append(r)
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [256, 32, 96, 100, 7, 1])
def test_encode_decode_bit_exact_random(fmt, dtype, H):
    x = wide_rows(37, H, dtype, seed=H)
    ours = mx_rows_cpu.encode_rows(x, fmt)
    theirs = torch_encode(x, fmt)
    same_bits(ours, theirs)
    same_bits(mx_rows_cpu.decode_rows(ours, fmt, H, dtype), torch_decode(theirs, fmt, H, dtype))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(fmt, dtype):
    x = special_rows(dtype, fmt)
    ours = mx_rows_cpu.encode_rows(x, fmt)
    same_bits(ours, torch_encode(x, fmt))
    same_bits(mx_rows_cpu.decode_rows(ours, fmt, x.shape[1], dtype), torch_decode(ours, fmt, x.shape[1], dtype))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_every_byte(fmt, dtype):
    """Every element byte under every scale byte (NaN elements and NaN scales included)."""
    H = 256
    elements = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row s: all 256 element bytes
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, H // 32)  # row s: scale byte s
    rows = torch.cat([elements, scales], dim=1)
    same_bits(mx_rows_cpu.decode_rows(rows, fmt, H, dtype), torch_decode(rows, fmt, H, dtype))


@pytest.mark.parametrize("fmt", FMTS)
def test_strided_decode_input(fmt):
    H, N = 100, 9
    x = wide_rows(N, H, torch.bfloat16, seed=5)
    packed = torch_encode(x, fmt)
    wide = torch.randint(0, 256, (N, packed.shape[1] + 13), dtype=torch.uint8)
    wide[:, 5:5 + packed.shape[1]] = packed
    view = wide[:, 5:5 + packed.shape[1]]  # a view into wider rows
    assert view.stride(0) != view.shape[1]
    same_bits(mx_rows_cpu.decode_rows(view, fmt, H, torch.bfloat16), torch_decode(packed, fmt, H, torch.bfloat16))
    p = Payload(H, torch.bfloat16, fmt)
    same_bits(p.decode(view), torch_decode(packed, fmt, H, torch.bfloat16))


@pytest.mark.parametrize("fmt", FMTS)
def test_payload_uses_the_codec_and_writes_the_torch_bytes(fmt, monkeypatch):
    x = wide_rows(16, 256, torch.bfloat16, seed=1)
    p = Payload(256, torch.bfloat16, fmt)
    calls = []
    for name in ("encode_rows", "decode_rows"):
        real = getattr(mx_rows_cpu, name)
        monkeypatch.setattr(mx_rows_cpu, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    rows = p.encode(x[:, :])
    same_bits(rows, torch_encode(x, fmt))
    same_bits(p.decode(rows), torch_decode(rows, fmt, 256, torch.bfloat16))
    assert calls == ["encode_rows", "decode_rows"]
    x_t = x.t().contiguous().t()  # non-contiguous input
    same_bits(p.encode(x_t), torch_encode(x, fmt))


@pytest.mark.parametrize("fmt", FMTS)
def test_fallback_without_the_library(fmt, monkeypatch):
    """No compiler (load_library() None): Payload takes the torch path and writes the same bytes."""
    x = wide_rows(8, 96, torch.float16, seed=2)
    p = Payload(96, torch.float16, fmt)
    with_codec = p.encode(x)
    monkeypatch.setattr(payload_module.mx_rows_cpu, "load_library", lambda: None)

    def refuse(*a):
        raise AssertionError("the C codec ran without its library")

    monkeypatch.setattr(mx_rows_cpu, "encode_rows", refuse)
    monkeypatch.setattr(mx_rows_cpu, "decode_rows", refuse)
    assert not mx_rows_cpu.encode_applies(x, fmt)
    rows = p.encode(x)
    same_bits(rows, with_codec)
    same_bits(p.decode(rows), torch_decode(rows, fmt, 96, torch.float16))
