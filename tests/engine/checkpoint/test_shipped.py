"""Shipped checkpoints by name (`--model mini`) and the default model of `locus serve`."""

from __future__ import annotations

import pytest

from locus.engine.checkpoint import loader
from locus.errors import LocusError


def test_missing_shipped_checkpoint_is_a_clear_error_and_serve_falls_back_to_tiny(monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "SHIPPED", {"mini": tmp_path / "absent"})
    assert loader.shipped_model("mini") is None
    assert loader.default_serve_model() == "tiny"
    with pytest.raises(LocusError, match="locus train"):
        loader.load("mini", device="cpu")
    with pytest.raises(LocusError, match="locus train"):
        loader.config_of("mini")


def test_shipped_checkpoint_loads_by_name_and_is_served_by_default():
    if loader.shipped_model("mini") is None:
        pytest.skip("locus/assets/mini is not in this checkout")
    assert loader.default_serve_model() == "mini"
    loaded = loader.load("mini", device="cpu")
    assert loaded.name == "mini" and not loaded.random_weights
    assert loader.config_of("mini") == loaded.model.config
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("def fibonacci(n):")) == "def fibonacci(n):"
