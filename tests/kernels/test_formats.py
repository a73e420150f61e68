"""locus/kernels/formats.py: MX block formats and row-wise FP8, against blocks worked out by hand from
the OCP MX v1.0 spec's rules, against torchao's MX implementation (a test-only dependency), and
against an independent float64 reference written here (brute-force nearest representable value)."""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

from locus.kernels.formats import (E2M1, E4M3, E5M2, FORMATS, INT8, QuantizedTensor, dequantize, get_format,
                                   quantize)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MX = ["mxfp8", "mxfp8_e5m2", "mxfp4", "mxint8"]


def torchao_mx():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    return mx


# ---- the independent reference: every representable element value, nearest with ties to an even code

def element_grid(element) -> list[tuple[float, int]]:
    """(value, code) of every non-negative finite value of the element format, from its bit fields."""
    if element is INT8:
        return [(i / 64, i) for i in range(128)]
    ebits, mbits = {"e4m3": (4, 3), "e5m2": (5, 2), "e2m1": (2, 1)}[element.name]
    bias = 2 ** (ebits - 1) - 1
    out = []
    for code in range(2 ** (ebits + mbits)):
        e, m = code >> mbits, code & (2**mbits - 1)
        value = (m / 2**mbits) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2**mbits) * 2.0 ** (e - bias)
        if value <= element.max_normal:
            out.append((value, code))
    return out


def nearest_even(v: float, grid: list[tuple[float, int]]) -> float:
    magnitude = min(abs(v), grid[-1][0])
    best = min(grid, key=lambda vc: (abs(vc[0] - magnitude), vc[1] & 1))  # a tie goes to the even code
    return math.copysign(best[0], v)


def reference_mx(x: torch.Tensor, name: str) -> torch.Tensor:
    """The spec's conversion then decode, block by block along the last dim, in Python floats."""
    fmt = FORMATS[name]
    grid = element_grid(fmt.element)
    out = []
    for row in x.double().reshape(-1, x.shape[-1]).tolist():
        decoded = []
        for start in range(0, len(row), 32):
            block = row[start:start + 32]
            if any(math.isnan(v) or math.isinf(v) for v in block):
                decoded += [math.nan] * len(block)
                continue
            amax = max(abs(v) for v in block)
            shared = -127 if amax == 0 else min(127, max(-127, math.frexp(amax)[1] - 1 - fmt.element.emax))
            X = 2.0**shared
            decoded += [nearest_even(v / X, grid) * X for v in block]
        out.append(decoded)
    return torch.tensor(out, dtype=torch.float64).reshape(x.shape)


def awkward_rows(seed: int = 0) -> torch.Tensor:
    """Rows spanning 60 orders of magnitude, ties, values past the saturation point, subnormal blocks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 96, generator=gen) * torch.logspace(-42, 30, 24)[:, None]
    x[3, :32] = 0.0  # an all-zero block
    x[4, 5] = 448 * 1.1  # one element past e4m3's max in a block whose amax sets the scale
    x[5, :32] = torch.arange(32) * 0.25  # many exact ties at small scales
    x[6, :32] = 1e-40  # float32 subnormals: the scale clamps at 2^-127
    return x


# ---- hand-computed blocks (OCP MX v1.0 section 6.3)

def test_mxfp8_block_by_hand():
    # amax 300: floor(log2 300) = 8, E4M3's emax is 8, so X = 2^0 (byte 127). Near 300 E4M3 steps by
    # 2^(8-3) = 32: 300 -> 288. 0.3 -> 0.3125 (step 2^-5 there). 1e-3 lies between 0 and E4M3's
    # smallest subnormal 2^-9, above half of it (2^-10): -> 2^-9.
    block = torch.zeros(32)
    block[:4] = torch.tensor([300.0, -0.3, 1e-3, 7.0])
    q = quantize(block, "mxfp8")
    assert q.scale.tolist() == [127]
    assert q.dequantize()[:4].tolist() == [288.0, -0.3125, 2.0**-9, 7.0]
    assert q.data.dtype == torch.float8_e4m3fn


def test_mxfp4_block_by_hand_and_nibble_order():
    # amax 7: floor(log2 7) = 2 = E2M1's emax, X = 1. 7 saturates to 6; 5 is a tie of 4 and 6 -> 4
    # (even code); 0.25 ties 0 and 0.5 -> 0; -0.75 ties 0.5 and 1 -> -1; 2.5 ties 2 and 3 -> 2.
    block = torch.zeros(32)
    block[:6] = torch.tensor([7.0, 5.0, 0.25, -0.75, 2.5, 1.5])
    q = quantize(block, "mxfp4")
    assert q.scale.tolist() == [127]
    assert q.dequantize()[:6].tolist() == [6.0, 4.0, 0.0, -1.0, 2.0, 1.5]
    # codes 7 (6.0), 6 (4.0), 0, 8|2 = 10 (-1.0), 4 (2.0), 3 (1.5): element 2i in the low nibble
    assert q.data[:3].tolist() == [0x67, 0xA0, 0x34]
    assert q.data.shape == (16,)


def test_scale_exponent_by_hand():
    # amax 0.1: floor(log2 0.1) = -4. MXFP4: -4 - 2 = -6 (byte 121), 0.1 * 64 = 6.4 -> 6, reads back 0.09375.
    # MXINT8 (emax 0): -4 (byte 123), 0.1 * 16 = 1.6 -> 102/64 = 1.59375 -> 0.099609375.
    block = torch.full((32,), 0.1)
    assert quantize(block, "mxfp4").scale.tolist() == [121]
    assert quantize(block, "mxfp4").dequantize()[0].item() == 0.09375
    q = quantize(block, "mxint8")
    assert q.scale.tolist() == [123] and q.data[0].item() == 102
    assert q.dequantize()[0].item() == 102 / 64 / 16


def test_mxint8_saturates_symmetrically():
    block = torch.full((32,), 1.999)  # amax in [1, 2): X = 1; 1.999 * 64 = 127.9 -> 128 -> saturates to 127
    block[1] = -1.999
    q = quantize(block, "mxint8")
    assert q.data[:2].tolist() == [127, -127]


def test_e8m0_range_is_clamped():
    tiny = torch.full((32,), 1e-40)  # floor(log2) = -133: the scale clamps at 2^-127
    q = quantize(tiny, "mxfp8")
    assert q.scale.tolist() == [0]
    assert q.dequantize()[0].item() == pytest.approx(1e-40, rel=2**-4)
    huge = torch.full((32,), 3e38)  # floor(log2) = 127; MXINT8's emax is 0, so the exponent is 127
    assert quantize(huge, "mxint8").scale.tolist() == [254]


# ---- edge cases

@pytest.mark.parametrize("name", MX)
def test_zero_block(name):
    x = torch.zeros(2, 64)
    x[1, 32:] = 1.0
    q = quantize(x, name)
    assert q.scale[0].tolist() == [0, 0] and q.scale[1, 0].item() == 0
    assert torch.equal(q.dequantize()[0], torch.zeros(64))
    assert torch.equal(q.dequantize()[1], x[1])


@pytest.mark.parametrize("name", MX)
@pytest.mark.parametrize("special", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_makes_its_block_nan(name, special):
    x = torch.ones(3, 64)
    x[1, 40] = special
    q = quantize(x, name)
    assert q.scale[1].tolist() == [127 - FORMATS[name].element.emax, 255]
    out = q.dequantize()
    assert out[1, 32:].isnan().all() and not out[1, :32].isnan().any()
    assert torch.equal(out[0], x[0]) and torch.equal(out[2], x[2])


@pytest.mark.parametrize("name", MX)
@pytest.mark.parametrize("n", [1, 7, 33, 40, 95])
def test_short_last_block_uses_its_own_elements(name, n):
    x = torch.randn(3, n) * 1000
    x[:, (n // 32) * 32:] *= 1e-3  # a last block far smaller than the rest: its own scale must follow it
    q = quantize(x, name)
    assert q.scale.shape == (3, -(-n // 32))
    assert q.data.shape == (3, (n + 1) // 2 if name == "mxfp4" else n)
    expected = reference_mx(x, name)
    torch.testing.assert_close(q.dequantize().double(), expected, rtol=0, atol=0)
    if name == "mxfp4" and n % 2:
        assert (q.data[:, -1] >> 4 == 0).all()  # the pad nibble


@pytest.mark.parametrize("name", [*MX, "fp8"])
def test_axis_other_than_last(name):
    x = torch.randn(3, 70, 5)  # [E, K, N], scales along K (the expert-weight layout)
    q = quantize(x, name, axis=1)
    t = quantize(x.transpose(1, 2).contiguous(), name, axis=-1)
    assert torch.equal(q.dequantize(), t.dequantize().transpose(1, 2))
    assert q.scale.shape == ((3, 3, 5) if name != "fp8" else (3, 1, 5))
    assert q.dequantize().shape == x.shape


def test_first_dim_indexing_selects_experts():
    x = torch.randn(6, 64, 8)
    q = quantize(x, "mxfp4", axis=1)
    assert torch.equal(q[[4, 1]].dequantize(), q.dequantize()[[4, 1]])
    assert torch.equal(q[2].dequantize(), q.dequantize()[2])
    assert torch.equal(q[torch.tensor([0, 5])].dequantize(), q.dequantize()[[0, 5]])


def test_storage_sizes():
    x = torch.randn(4, 64, 256)
    assert quantize(x, "mxfp8", axis=1).nbytes == 4 * 64 * 256 + 4 * 2 * 256
    assert quantize(x, "mxfp4", axis=1).nbytes == 4 * 32 * 256 + 4 * 2 * 256
    assert quantize(x, "fp8", axis=1).nbytes == 4 * 64 * 256 + 4 * 256 * 4
    assert quantize(x, "mxfp8", axis=1).element_size() == pytest.approx(1 + 1 / 32)
    assert get_format("mxfp4").nbytes(64) == 34 and get_format("fp8").nbytes(64) == 68


def test_unknown_format_and_bad_input():
    with pytest.raises(ValueError, match="unknown format 'fp6'"):
        quantize(torch.ones(32), "fp6")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(32, dtype=torch.int32), "mxfp8")


# ---- against the independent float64 reference and against torchao

@pytest.mark.parametrize("name", MX)
def test_matches_float64_reference(name):
    x = awkward_rows()
    torch.testing.assert_close(quantize(x, name).dequantize().double(), reference_mx(x, name), rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("name, dtype", [("mxfp8", "float8_e4m3fn"), ("mxfp8_e5m2", "float8_e5m2"),
                                         ("mxfp4", "float4_e2m1fn_x2")])
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_matches_torchao_bit_for_bit(name, dtype, source):
    mx = torchao_mx()
    x = awkward_rows(seed=1).clamp(-1e38, 1e38).to(source)
    x[7, 3], x[8, 40] = math.nan, math.inf
    scale, data = mx.to_mx(x.contiguous(), getattr(torch, dtype), 32)
    q = quantize(x, name)
    # One deliberate difference: torchao reads an Inf's exponent field as 2^128 and gives its block a
    # finite scale (the Inf then saturates); here any block with an Inf is NaN, like one with a NaN.
    assert q.scale[8, 1].item() == 255 and scale.view(torch.uint8)[8, 1].item() != 255
    x[8, 40] = math.nan
    scale, data = mx.to_mx(x.contiguous(), getattr(torch, dtype), 32)
    assert torch.equal(q.scale, scale.view(torch.uint8))
    # Compared element for element: blocks with a finite scale above 2^-127. torchao leaves NaN
    # elements in NaN blocks, and where the scale is 2^-127 (a float32 subnormal) it divides by
    # 2^-126 instead (its code says so), so those elements come out halved there.
    same = (q.scale != 255) & (q.scale != 0)
    assert same.sum() > 40
    blocks = same.repeat_interleave(32, dim=-1)
    packed = blocks[:, ::2] if name == "mxfp4" else blocks
    assert torch.equal(q.data.view(torch.uint8)[packed], data.view(torch.uint8)[packed])
    theirs = mx.to_dtype(data, scale, getattr(torch, dtype), 32, torch.float32)
    torch.testing.assert_close(q.dequantize()[blocks], theirs[blocks], rtol=0, atol=0)
    assert q.dequantize()[~same.repeat_interleave(32, dim=-1) & (q.scale == 255).repeat_interleave(32, -1)].isnan().all()


def test_mxfp4_packing_is_torchs_float4_layout():
    q = quantize(torch.tensor([0.5, 6.0] + [0.0] * 30), "mxfp4")
    assert q.data.view(torch.float4_e2m1fn_x2).shape == (16,)
    assert q.data[0].item() == 0x71  # 0.5 is code 1 (low nibble, first), 6.0 code 7


# ---- round trips

BOUND = {"mxfp8": 2**-4, "mxfp8_e5m2": 2**-3, "mxfp4": 2**-2, "mxint8": 2**-6, "fp8": 2**-4}


@pytest.mark.parametrize("name", [*MX, "fp8"])
@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_error_bound(name, device):
    """Each element within half a step of its binade, and saturated elements within the saturation
    gap; measured in units of the block's (row's) amax: the bound is 2^-(mbits+1) relative to the
    element's own magnitude for floats, half of 2^-6 * X for MXINT8."""
    x = torch.randn(64, 256, device=device, generator=torch.Generator(device).manual_seed(3))
    q = quantize(x, name)
    err = (q.dequantize() - x).abs()
    element = FORMATS[name].element
    if element is INT8:
        scale = dequantize(QuantizedTensor(torch.ones_like(q.data), q.scale, name, q.shape, q.axis)) * 64
        gap = (x.abs() - element.max_normal * scale).clamp(min=0)
        assert (err <= scale * 2**-7 + gap + 1e-6 * x.abs()).all()
    else:
        gap = (x.abs() - element.max_normal * _scale_of(q)).clamp(min=0)
        assert (err <= x.abs() * 2.0 ** -(element.mbits + 1) + gap + _subnormal_step(q) / 2 + 1e-6 * x.abs()).all()
    rel_rms = (err.square().mean() / x.square().mean()).sqrt().item()
    assert rel_rms < BOUND[name], rel_rms


def _scale_of(q: QuantizedTensor) -> torch.Tensor:
    """The scale each element was divided by, broadcast to q's shape."""
    if q.fmt.is_mx:
        ones = QuantizedTensor(torch.full_like(q.data, 0x22) if q.format == "mxfp4" else
                               torch.ones(q.data.shape, device=q.device).to(q.data.dtype), q.scale, q.format,
                               q.shape, q.axis)
        return dequantize(ones)
    return q.scale.expand(q.shape)


def _subnormal_step(q: QuantizedTensor) -> torch.Tensor:
    element = q.fmt.element
    ebits = {"e4m3": 4, "e5m2": 5, "e2m1": 2}[element.name]
    return _scale_of(q) * 2.0 ** (2 - 2 ** (ebits - 1) - element.mbits)


def test_rowwise_fp8():
    w = torch.randn(16, 64) * torch.logspace(-3, 3, 16)[:, None]
    w[2] = 0.0
    w[5, 7] = math.nan
    q = quantize(w, "fp8")
    assert q.scale.shape == (16, 1) and q.scale.dtype == torch.float32 and q.data.dtype == torch.float8_e4m3fn
    amax = w.abs().amax(-1, keepdim=True)
    good = torch.ones(16, dtype=torch.bool)
    good[[2, 5]] = False
    torch.testing.assert_close(q.scale[good], amax[good] / 448)
    assert q.data.float().abs().amax(-1)[good].eq(448).all()  # the row's amax lands on E4M3's max
    assert torch.equal(q.dequantize()[2], torch.zeros(64))
    assert q.dequantize()[5].isnan().all()
    # each element: E4M3 of w / scale, rounded to nearest-even
    expected = (w[good] / q.scale[good]).to(torch.float8_e4m3fn)
    assert torch.equal(q.data[good].view(torch.uint8), expected.view(torch.uint8))


def test_element_grids_are_the_spec_tables():
    assert [v for v, _ in element_grid(E2M1)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert element_grid(E4M3)[-1][0] == 448.0 and element_grid(E4M3)[1][0] == 2.0**-9
    assert element_grid(E5M2)[-1][0] == 57344.0 and element_grid(E5M2)[1][0] == 2.0**-16
    # the decoded E4M3 / E5M2 grids are torch's own float8 values
    for element in (E4M3, E5M2):
        values = torch.tensor([v for v, _ in element_grid(element)])
        assert torch.equal(values.to(element.torch_dtype).float(), values)


def test_e4m3_nan_codes_read_back_nan():
    q = quantize(torch.ones(32), "mxfp8")
    q.data.view(torch.uint8)[:2] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)
    out = q.dequantize()
    assert out[:2].isnan().all() and not out[2:].isnan().any()


def test_every_code_round_trips():
    """Every finite element value, scaled by a few powers of two, quantizes to itself."""
    for name, element in [("mxfp8", E4M3), ("mxfp8_e5m2", E5M2), ("mxfp4", E2M1), ("mxint8", INT8)]:
        values = torch.tensor([v for v, _ in element_grid(element)])
        values = torch.cat([values, -values])
        rows = torch.zeros(-(-values.numel() // 31) * 31)
        rows[:values.numel()] = values
        rows = rows.view(-1, 31)
        blocks = torch.cat([rows, torch.full((rows.shape[0], 1), element.max_normal)], dim=1)  # X = 1
        for shift in (-20, 0, 9):
            x = torch.ldexp(blocks, torch.tensor(shift))
            assert torch.equal(quantize(x, name).dequantize(), x), (name, shift)


def test_product_of_formats_is_complete():
    # every MX format quantizes every float dtype torch has on every device here
    for name, dtype, device in itertools.product(FORMATS, [torch.float32, torch.bfloat16, torch.float16], DEVICES):
        x = torch.randn(2, 64, dtype=dtype, device=device)
        q = quantize(x, name)
        assert q.device.type == device and q.dequantize(dtype).dtype == dtype
