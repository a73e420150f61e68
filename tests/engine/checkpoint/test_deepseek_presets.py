"""`locus init-model --preset tiny-deepseek-v3 / tiny-deepseek-v2-lite` writes what transformers'
DeepseekV3ForCausalLM / DeepseekV2ForCausalLM load (config.json and key names), with the same logits."""

from __future__ import annotations

import pytest
import torch

from locus.cli import main
from locus.engine.checkpoint.loader import load
from locus.engine.model.forward_batch import ForwardBatch


@pytest.mark.parametrize("preset, architecture", [("tiny-deepseek-v3", "DeepseekV3ForCausalLM"),
                                                  ("tiny-deepseek-v2-lite", "DeepseekV2ForCausalLM")])
def test_init_model_writes_what_transformers_reads_with_the_same_logits(tmp_path, preset, architecture):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "ck"
    assert main(["init-model", "--preset", preset, "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == architecture
    ours = load(preset, device="cpu").model
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")] == [1, 2, 3] == \
        list(ours.config.moe_layers)
    from_disk = load(str(out), device="cpu").model
    ids = [1, 72, 101, 108, 108, 111] * 6
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
        got = ours.compute_logits(ours(ForwardBatch.single(ids)).hidden)
        again = from_disk.compute_logits(from_disk(ForwardBatch.single(ids)).hidden)
    assert (got - expected).abs().max().item() < 1e-4 and expected.std() > 0.1
    assert torch.equal(got, again)
