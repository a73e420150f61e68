"""The trained byte-level BPE: round trips, Locus's special tokens, and what Locus/transformers read."""

from __future__ import annotations

import pytest

from locus.engine.checkpoint.tokenizer import HFTokenizer
from locus.training.tokenizer import SPECIAL_TOKENS, save_tokenizer_files, special_ids, train_tokenizer
from tests.training.conftest import C, DE, EN, PY

TEXTS = ["Ünïcödé ✓ 数学 — «quotes» ", "def add(a, b):\n\treturn a + b  # tabs and  spaces\n", "12 * 34 = 408\n", ""]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer((EN + DE + [PY, C]) * 20, vocab_size=320)


def test_round_trip_any_text(tok):
    for text in TEXTS + EN + DE + [PY, C]:
        enc = tok.encode(text)
        assert enc.ids[0] == special_ids(tok)["bos"]
        assert tok.decode(enc.ids) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_specials_take_the_first_ids_and_merges_shorten_text(tok):
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert special_ids(tok) == {"bos": 0, "eos": 1, "pad": 2}
    assert tok.get_vocab_size() == 320
    text = EN[0]
    assert len(tok.encode(text, add_special_tokens=False).ids) < len(text.encode()) / 1.5


def test_locus_and_transformers_read_the_saved_files(tok, tmp_path):
    save_tokenizer_files(tok, tmp_path, model_max_length=512)
    ours = HFTokenizer(tmp_path, 320, (1,))
    assert ours.bos_token_id == 0 and ours.eos_token_ids == (1,)
    chat = ours.apply_chat_template([{"role": "user", "content": "Hallo"}])
    assert chat == "<|begin_of_text|><|header_start|>user<|header_end|>\n\nHallo<|eot|><|header_start|>assistant<|header_end|>\n\n"
    ids = ours.encode(chat, add_special_tokens=False)
    assert ids.count(0) == 1 and ids.count(1) == 1 and ours.decode(ids, skip_special_tokens=False) == chat
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert ref(text)["input_ids"] == ours.encode(text)
    assert ref.apply_chat_template([{"role": "user", "content": "Hallo"}], tokenize=False, add_generation_prompt=True) == chat
