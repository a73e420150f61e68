"""The shipped `mini` checkpoint has learned its domains: on held-out documents of each domain its loss
is below that domain's unigram entropy (the loss of a model that ignores context) by MARGIN nats a token."""

from __future__ import annotations

import json

import pytest
import torch

from locus.engine.checkpoint.loader import shipped_model
from locus.engine.checkpoint.weights import load_model
from locus.engine.model.forward_batch import ForwardBatch
from locus.training.tokenizer import load_trained, special_ids
from locus.training.train import token_losses

MARGIN = 1.0  # nats per token
MAX_TOKENS = 512  # per domain


@pytest.fixture(scope="module")
def mini():
    path = shipped_model("mini")
    if path is None:
        pytest.skip("locus/assets/mini is not in this checkout")
    return path, load_model(path, dtype=torch.float32)


def test_heldout_loss_per_domain_is_below_unigram_entropy(mini):
    path, model = mini
    tok = load_trained(path / "tokenizer.json")
    ids = special_ids(tok)
    report = json.loads((path / "training.json").read_text())
    sample = json.loads((path / "heldout_sample.json").read_text())["documents"]
    assert set(sample) == set(report["unigram_entropy"]) and len(sample) >= 6
    losses = {}
    for domain, docs in sample.items():
        stream = [t for doc in docs for t in (ids["bos"], *tok.encode(doc, add_special_tokens=False).ids, ids["eos"])]
        x = torch.tensor([stream[:MAX_TOKENS + 1]])
        assert x.shape[1] > 200, domain  # a few hundred tokens at least
        with torch.no_grad():
            losses[domain] = token_losses(model, x).mean().item()
    bars = {d: report["unigram_entropy"][d] - MARGIN for d in losses}
    assert all(losses[d] < bars[d] for d in losses), {d: (round(losses[d], 3), round(bars[d], 3)) for d in losses}


def test_transformers_loads_it_with_equal_logits(mini):
    transformers = pytest.importorskip("transformers")
    path, model = mini
    hf = transformers.Llama4ForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    tok = load_trained(path / "tokenizer.json")
    ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 6).ids[:200]  # > the 128-token chunk
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
        got = model.compute_logits(model(ForwardBatch.single(ids)).hidden)
    assert (got - expected).abs().max().item() < 1e-3
