"""A byte-level BPE tokenizer trained with HuggingFace `tokenizers`, with Locus's Llama-4 specials.

The special tokens are the byte tokenizer's (locus/engine/checkpoint/tokenizer.py): `<|begin_of_text|>`
(bos, added in front of every encoded text), `<|eot|>` (eos), `<|pad|>`, `<|header_start|>` and
`<|header_end|>` (the chat format). They take ids 0..4 and the 256 byte symbols follow, so any text
encodes. `save_tokenizer_files` writes what a HuggingFace checkpoint carries: tokenizer.json,
tokenizer_config.json (bos/eos/pad names and the chat template) and special_tokens_map.json; Locus's
HFTokenizer and transformers' AutoTokenizer both read them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from locus.engine.checkpoint.tokenizer import ByteTokenizer

BOS, EOS, PAD = "<|begin_of_text|>", "<|eot|>", "<|pad|>"
# in id order: ids 0..4
SPECIAL_TOKENS = sorted(ByteTokenizer.SPECIALS, key=ByteTokenizer.SPECIALS.get)
# Llama-4's header format (the byte tokenizer's built-in format, as a Jinja template)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|eot|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|header_start|>assistant<|header_end|>\\n\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """A byte-level BPE of `vocab_size` ids (specials and the 256 bytes included) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos_id)])
    return tok


def special_ids(tok) -> dict[str, int]:
    return {"bos": tok.token_to_id(BOS), "eos": tok.token_to_id(EOS), "pad": tok.token_to_id(PAD)}


def save_tokenizer_files(tok, out_dir: str | Path, model_max_length: int) -> None:
    out_dir = Path(out_dir)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2) + "\n")


def load_trained(path: str | Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
