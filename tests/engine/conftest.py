"""Engine tests' shared model and tokenizer (the tiny preset's random weights, the byte tokenizer)."""

import pytest

from locus.engine.checkpoint.presets import build_preset
from locus.engine.checkpoint.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny", seed=0)


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer(ByteTokenizer.MIN_VOCAB)
