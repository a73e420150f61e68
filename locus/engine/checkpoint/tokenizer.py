"""Tokenizers: a checkpoint's `tokenizer.json` (HF `tokenizers`), or a built-in byte-level one.

With `tokenizer.json` present, the chat template comes from `tokenizer_config.json` (or a
`chat_template.jinja` file) and is rendered with a sandboxed jinja2 environment, as transformers does.
Without one, `ByteTokenizer` maps each UTF-8 byte to its own id and adds a few Llama-4-style special
tokens, so the embedded default model runs with no download at all.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

from locus.chat_template import find_chat_template, read_chat_template, read_json, render_chat_template  # noqa: F401 (re-exported)
from locus.errors import LocusError


class Tokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # the tokenizer's own end-of-text (tokenizer_config's eos_token), one of eos_token_ids: a
    # sequence it ends reports stop_reason null, the others their id (as vLLM's)
    eos_token_id: int | None
    # the longest text one token stands for, in characters: a text of C characters has at least
    # C / max_token_chars tokens, so an oversized prompt is refused without tokenizing it
    max_token_chars: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


class ByteTokenizer:
    """ids 0..255 are raw bytes; special tokens follow. The chat format mirrors Llama-4's headers."""

    BOS, EOS, PAD, HEADER_START, HEADER_END = 256, 257, 258, 259, 260
    SPECIALS = {"<|begin_of_text|>": BOS, "<|eot|>": EOS, "<|pad|>": PAD,
                "<|header_start|>": HEADER_START, "<|header_end|>": HEADER_END}
    MIN_VOCAB = 261
    # the built-in chat format (apply_chat_template) as a Jinja template, for clients that render it
    # themselves (/tokenizer_info); tests check that the two agree
    CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
                     "{{ '<|header_start|>' + message['role'] + '<|header_end|>\n\n' }}"
                     "{% if message['content'] is string %}{{ message['content'] }}"
                     "{% elif message['content'] %}{% for part in message['content'] %}"
                     "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
                     "{{ '<|eot|>' }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<|header_start|>assistant<|header_end|>\n\n' }}{% endif %}")
    _special_re = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")

    def __init__(self, vocab_size: int = MIN_VOCAB):
        if vocab_size < self.MIN_VOCAB:
            raise LocusError(f"the byte tokenizer needs a vocabulary of at least {self.MIN_VOCAB} ids; the model has {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = self.BOS
        self.eos_token_ids = (self.EOS,)
        self.eos_token_id = self.EOS
        self._names = {v: k for k, v in self.SPECIALS.items()}
        self.max_token_chars = max(len(name) for name in self.SPECIALS)
        self.chat_template: str | None = None  # a Jinja template (--chat-template) instead of the built-in format

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.BOS] if add_special_tokens else []
        for piece in self._special_re.split(text):
            if piece in self.SPECIALS:
                ids.append(self.SPECIALS[piece])
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            if buf:  # (a run of special ids decodes no empty buffers: the detokenizer calls this per token)
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
            if not skip_special_tokens:
                out.append(self._names.get(i, f"<|reserved_{i}|>"))
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a special token: its name)."""
        if token_id < 256:
            return bytes([token_id])
        return self._names.get(token_id, f"<|reserved_{token_id}|>").encode()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """<|begin_of_text|> then <|header_start|>role<|header_end|>\\n\\ncontent<|eot|> per message."""
        if self.chat_template is not None:
            return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                        bos_token="<|begin_of_text|>", eos_token="<|eot|>")
        parts = ["<|begin_of_text|>"]
        for m in messages:
            parts.append(f"<|header_start|>{m['role']}<|header_end|>\n\n{_content_text(m.get('content'))}<|eot|>")
        if add_generation_prompt:
            parts.append("<|header_start|>assistant<|header_end|>\n\n")
        return "".join(parts)


def _content_text(content: Any) -> str:
    """OpenAI content may be a string or a list of parts; only text parts carry meaning here."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


class HFTokenizer:
    def __init__(self, model_dir: Path, vocab_size: int, eos_from_config: tuple[int, ...]):
        from tokenizers import Tokenizer as _Tok

        path = model_dir / "tokenizer.json"
        try:
            self._tok = _Tok.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise LocusError(f"{path}: cannot load tokenizer ({exc})") from None
        cfg = read_json(model_dir / "tokenizer_config.json") or {}
        self.config = cfg  # tokenizer_config.json as written (/tokenizer_info serves it)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids = set(eos_from_config)
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos_ids))
        self.vocab_size = vocab_size
        self.chat_template = find_chat_template(model_dir, cfg)
        # vocabulary strings are at least as long as the text they decode to (byte-level and
        # sentencepiece alphabets spell one character with one or more symbols)
        self.max_token_chars = max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise LocusError("this tokenizer has no chat template (tokenizer_config.json has no chat_template)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def load_tokenizer(model_dir: str | Path | None, vocab_size: int, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    """The checkpoint's tokenizer.json if there is one, else the byte tokenizer."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(Path(model_dir), vocab_size, eos_token_ids)
    return ByteTokenizer(vocab_size)
