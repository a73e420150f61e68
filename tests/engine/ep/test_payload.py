"""The rows of an expert-parallel exchange in their payload formats (--ep-dispatch-format /
--ep-combine-format): what a row's bytes are, that they decode to the format's dequantized values,
how they pack with the routing metadata, and the one-process stand-in the parity tests compare to.
The exchanges over real process groups are in test_expert_parallel.py (slow)."""

from __future__ import annotations

import math

import pytest
import torch

from locus.engine.ep.ranks.launch import setup_from
from locus.engine.ep.payload import Payload, simulate_dispatch
from locus.engine.ep.transport import RowFormat
from locus.engine.checkpoint.presets import build_preset
from locus.engine.model.forward_batch import ForwardBatch
from locus.errors import LocusError
from locus.kernels.formats import PAYLOAD_FORMATS, payload_row_bytes, quantize


@pytest.mark.parametrize("H", [64, 100, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_its_values_bytes_or_the_formats_elements_then_scales(H, dtype):
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(H)).to(dtype) * 3
    model = Payload(H, dtype)
    assert model.nbytes == H * dtype.itemsize == payload_row_bytes(H, "model", dtype.itemsize)
    assert torch.equal(model.decode(model.encode(x)), x)
    for fmt in ("mxfp8", "mxint8"):
        p = Payload(H, dtype, fmt)
        assert p.nbytes == H + math.ceil(H / 32) == payload_row_bytes(H, fmt, dtype.itemsize)
        rows = p.encode(x)
        q = quantize(x, fmt, axis=1)
        assert rows.shape == (5, p.nbytes) and rows.dtype == torch.uint8
        assert torch.equal(rows[:, :H], q.data.view(torch.uint8))  # H one-byte elements
        assert torch.equal(rows[:, H:], q.scale)  # then the E8M0 scale of each 32 values
        back = p.decode(rows)
        assert back.dtype == dtype and torch.equal(back, q.dequantize(dtype))
        assert torch.equal(p.round_trip(x), back)
        # a decoded row encodes to the same bytes: a proxy's forwarded row is what the source sent
        assert torch.equal(p.encode(back), rows)
        rel = ((back.float() - x.float()).norm() / x.float().norm()).item()
        assert rel < (2**-4 if fmt == "mxfp8" else 2**-6)


def test_empty_batches_encode_and_decode():
    for fmt in PAYLOAD_FORMATS:
        p = Payload(64, torch.float32, fmt)
        rows = p.encode(torch.zeros(0, 64))
        assert rows.shape == (0, p.nbytes)
        assert p.decode(rows).shape == (0, 64)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxint8"])
@pytest.mark.parametrize("H", [64, 100])
def test_packed_rows_carry_the_quantized_payload_and_the_metadata(fmt, H):
    K = 2
    f = RowFormat(H, K, torch.bfloat16, fmt, "mxfp8")
    x_bytes = H + math.ceil(H / 32)
    assert f.x_bytes == x_bytes and f.combine.nbytes == x_bytes
    assert f.meta_bytes == K * 4 + K * 2
    # the slots start 8-aligned after the payload (66 bytes for H 64: 72)
    assert f.row_bytes == 8 * math.ceil((8 * math.ceil(x_bytes / 8) + K * 6) / 8)
    assert f.row_bytes < RowFormat(H, K, torch.bfloat16).row_bytes
    x = torch.randn(3, H).bfloat16()
    slots = torch.tensor([[0, 5], [3, -1], [7, 2]])
    weights = torch.rand(3, K).bfloat16()
    delivered = f.delivery(f.pack(f.dispatch.encode(x), slots, weights), route=None)
    assert torch.equal(delivered.x, f.dispatch.round_trip(x))
    assert torch.equal(delivered.encoded, f.dispatch.encode(x))
    assert torch.equal(delivered.slots, slots) and torch.equal(delivered.weights, weights)
    padding = f.delivery(f.padding(2, "cpu"), route=None)
    assert torch.equal(padding.x, torch.zeros(2, H, dtype=torch.bfloat16))  # zero bytes decode to zero
    assert (padding.slots == -1).all()


def test_the_one_process_stand_in_rounds_only_the_routed_experts_input():
    from locus.engine.model.moe import MoEBlock
    from locus.kernels import fused_moe

    model = build_preset("tiny", seed=0)
    block = next(m for m in model.modules() if isinstance(m, MoEBlock))
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain, topk = block(x)
        simulate_dispatch(model, "mxfp8")
        rounded, topk_rounded = block(x)
        simulate_dispatch(model, "model")
        again, _ = block(x)
        e = block.experts
        want = block.shared_expert(x) + fused_moe(Payload(x.shape[1], x.dtype, "mxfp8").round_trip(x), e.gate_up_proj,
                                                  e.down_proj, topk.ids, topk.weights, weight_on_input=True,
                                                  backend=block.moe_backend)
    assert torch.equal(plain, again)
    assert torch.equal(topk.ids, topk_rounded.ids)  # the router sees the rows as they are
    assert torch.allclose(rounded, want, atol=1e-6) and not torch.allclose(rounded, plain, atol=1e-6)
    # and a whole forward runs with it
    simulate_dispatch(model, "mxint8")
    with torch.no_grad():
        assert torch.isfinite(model.compute_logits(model(ForwardBatch.single(list(range(1, 9)))).hidden)).all()


def test_formats_are_checked_by_name():
    with pytest.raises(LocusError, match="--ep-dispatch-format 'fp8'"):
        setup_from(2, None, 60.0, None, dispatch_format="fp8")
    with pytest.raises(LocusError, match="--ep-combine-format 'mxfp4'"):
        setup_from(2, None, 60.0, None, combine_format="mxfp4")
    setup = setup_from(2, None, 60.0, None, dispatch_format="mxfp8", combine_format="mxint8")
    assert (setup.dispatch_format, setup.combine_format) == ("mxfp8", "mxint8")
    with pytest.raises(ValueError, match="unknown payload format"):
        payload_row_bytes(64, "fp8", 2)


def test_the_clis_offer_the_payload_formats():
    from locus.routing import cli as routing_cli
    from locus.server import cli as server_cli

    assert server_cli.EP_PAYLOAD_FORMATS == routing_cli.PAYLOAD_FORMATS == PAYLOAD_FORMATS


def test_serve_refuses_a_payload_format_without_expert_parallelism(capsys, monkeypatch):
    from locus.cli import main

    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(["serve", "--model", "tiny", "--ep-combine-format", "mxint8"]) == 2
    assert "add --ep-ranks N" in capsys.readouterr().err
