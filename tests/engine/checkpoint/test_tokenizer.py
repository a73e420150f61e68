"""Byte tokenizer and HF tokenizer.json + jinja chat templates (checked against transformers)."""

from __future__ import annotations

import json

import pytest

from locus.engine.checkpoint.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from locus.errors import LocusError

LLAMA4_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
    "{{ m['content'] | trim }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)


def test_byte_tokenizer_round_trips_unicode_and_specials():
    tok = ByteTokenizer(512)
    text = "héllo, wörld ✓ 数"
    ids = tok.encode(text)
    assert ids[0] == tok.BOS and all(i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    ids = tok.encode(chat, add_special_tokens=False)
    assert ids.count(tok.BOS) == 1 and ids.count(tok.EOS) == 1 and tok.HEADER_START in ids
    assert tok.decode(ids, skip_special_tokens=False) == chat
    assert tok.decode(ids) == "user\n\nhiassistant\n\n"


def test_byte_tokenizer_needs_room_in_the_vocabulary():
    with pytest.raises(LocusError, match="at least 261"):
        ByteTokenizer(200)


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|eot|>": 2, "<|header_start|>": 3, "<|header_end|>": 4}
    for word in "hello world user assistant how are you ? ! \n".split(" "):
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|begin_of_text|>", "<|eot|>", "<|header_start|>", "<|header_end|>"])
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": {"__type": "AddedToken", "content": "<|eot|>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False},
        "chat_template": LLAMA4_STYLE_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return tmp_path


def test_hf_tokenizer_encodes_like_transformers(hf_tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))
    tok = load_tokenizer(hf_tokenizer_dir, vocab_size=64, eos_token_ids=(2,))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world how are you") == ref("hello world how are you")["input_ids"]
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    messages = [{"role": "user", "content": " how are you "}, {"role": "assistant", "content": "hello"}]
    for gen in (True, False):
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == ref.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen)
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_chat_template_errors_are_clear(hf_tokenizer_dir):
    cfg = json.loads((hf_tokenizer_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages|length > 1 %}{{ raise_exception('only one message') }}{% endif %}ok"
    (hf_tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(hf_tokenizer_dir, 64)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(LocusError, match="only one message"):
        tok.apply_chat_template([{"role": "user", "content": "x"}] * 2)


def test_without_tokenizer_json_the_byte_tokenizer_is_used(tmp_path):
    assert isinstance(load_tokenizer(tmp_path, 512), ByteTokenizer)


def test_chat_template_flag_reads_a_file_or_the_text_and_checks_its_syntax(tmp_path):
    from locus.engine.checkpoint.tokenizer import read_chat_template

    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(LocusError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(LocusError, match="syntax error at line 1"):
        read_chat_template("{% for m in messages %}")
    tok = ByteTokenizer()
    tok.chat_template = read_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"
