"""The scoring API: what eval harnesses (lm-evaluation-harness's `local-completions`, ...) use to
score text through /v1/completions, as OpenAI's legacy API and vLLM define it.

- `echo`: each choice's `text` starts with its prompt's text; with `logprobs`, the prompt's tokens
  come first in `logprobs` (the first token's `token_logprobs` and `top_logprobs` are null: nothing
  precedes it), then the generated ones. Streamed, a choice's first chunk carries the prompt.
- `max_tokens: 0` with `echo` scores the prompt and generates nothing (the engine samples nothing).
- `text_offset` indexes the choice's text: token i's piece of it is text[offset_i:offset_{i+1}]
  (token_pieces, echo_offsets).
- `GET /tokenizer_info`: the tokenizer's configuration, as vLLM serves it (its tokenizer_config.json
  without file paths, with `tokenizer_class` and the chat template), which lm-eval's remote tokenizer
  reads, then /tokenize and /detokenize.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from locus.engine.core.detokenizer import IncrementalDetokenizer
from locus.engine.sampling.sampler import SamplingParams, TokenLogprob
from locus.engine.checkpoint.tokenizer import ByteTokenizer, Tokenizer

# (token id, its logprob, the alternatives best first); logprob and alternatives None for a prompt's first token
Entry = tuple[int, "float | None", "list[tuple[int, float]] | None"]


@dataclass
class PromptEcho:
    """What `echo` puts before each prompt's completion: the prompt as the client wrote it (texts),
    or the text its token ids decode to (special tokens written out, as vLLM does)."""

    texts: list[str] | None  # one per prompt, for text prompts; None for token-id prompts
    tokenizer: Tokenizer

    @classmethod
    def of(cls, body, tokenizer: Tokenizer) -> "PromptEcho | None":
        if not body.echo:
            return None
        prompt = body.prompt
        if isinstance(prompt, str):
            return cls([prompt], tokenizer)
        if prompt and all(isinstance(p, str) for p in prompt):
            return cls(list(prompt), tokenizer)
        return cls(None, tokenizer)

    def text(self, prompt_index: int, prompt_ids: list[int]) -> str:
        if self.texts is not None:
            return self.texts[prompt_index]
        return self.tokenizer.decode(prompt_ids, skip_special_tokens=False)

    def offsets(self, text: str, prompt_ids: list[int]) -> list[int]:
        """Where each prompt token's piece starts in the echoed `text`."""
        return echo_offsets(token_pieces(self.tokenizer, prompt_ids, skip_special_tokens=False), text)


def token_pieces(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool, context: list[int] = ()) -> list[str]:
    """Each token's piece of the text `ids` decode to (after `context`, the tokens before them): the
    characters it completes. A character whose bytes are split over tokens (byte-level BPE) belongs to
    the token that completes it and the ones before get "", so the pieces add up to the text; a token's
    own text (`tokens`, `token_id:N` for a partial character) is another thing. The engine's
    detokenizer window decodes each token in context, as the output text is decoded."""
    detokenizer = IncrementalDetokenizer(tokenizer, list(context), SamplingParams(skip_special_tokens=skip_special_tokens))
    pieces = [detokenizer.add(t).text_delta for t in ids]
    if pieces:
        pieces[-1] += detokenizer.flush()  # bytes that never complete a character: U+FFFD, as decode gives
    return pieces


class OutputOffsets:
    """text_offset of a choice's generated tokens, as they come (streamed or whole): each token's
    piece decoded in the context of the prompt's last tokens and with the request's
    skip_special_tokens, as the output text is; the first at `start` (the echoed prompt's length)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool, start: int = 0):
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(skip_special_tokens=skip_special_tokens))
        self.next = start  # where the next token's piece starts

    def take(self, ids: list[int]) -> list[int]:
        offsets = []
        for token_id in ids:
            offsets.append(self.next)
            self.next += len(self._detokenizer.add(token_id).text_delta)
        return offsets


def text_offsets(pieces: list[str], start: int = 0) -> list[int]:
    """Where each piece starts, the first at `start`."""
    offsets = []
    for piece in pieces:
        offsets.append(start)
        start += len(piece)
    return offsets


def echo_offsets(pieces: list[str], text: str) -> list[int]:
    """text_offset of a prompt's tokens in its echoed `text`. A text prompt echoes the client's own
    text, which does not hold the special tokens the tokenizer put before it (BOS): their pieces take
    no room in it. A tokenizer that does not give back the text it was given (a normalizer) leaves
    offsets into the decoded text, kept within `text`."""
    decoded = "".join(pieces)
    shift = len(decoded) - len(text) if decoded.endswith(text) else 0
    return [min(len(text), max(0, offset - shift)) for offset in text_offsets(pieces)]


def prompt_entries(prompt_ids: list[int], scored: list[TokenLogprob | None] | None) -> list[Entry]:
    """The prompt's part of an echoed `logprobs`: one entry per prompt token."""
    if scored is None or len(scored) != len(prompt_ids):
        raise RuntimeError(f"the engine scored {0 if scored is None else len(scored)} of {len(prompt_ids)} prompt tokens")
    return [(t, None, None) if e is None else (t, e.logprob, e.top) for t, e in zip(prompt_ids, scored)]


def output_entries(items: list[TokenLogprob]) -> list[Entry]:
    return [(lp.token_id, lp.logprob, lp.top) for lp in items]


def token_strings(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (/tokenize's return_token_strs), special tokens written out."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


# tokenizer_config.json fields that name files on the machine that made the checkpoint (vLLM drops them
# too), or that are large and no client reads
_DROPPED = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path", "added_tokens_decoder")


def tokenizer_info(tokenizer: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """GET /tokenizer_info: the tokenizer's configuration, `tokenizer_class`, the chat template in
    use, and `model_max_length` = this server's context limit (what a request may hold)."""
    if isinstance(tokenizer, ByteTokenizer):
        info: dict[str, Any] = {"tokenizer_class": "ByteTokenizer", "add_bos_token": True, "add_eos_token": False,
                                "bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "pad_token": "<|pad|>",
                                "clean_up_tokenization_spaces": False}
        template = tokenizer.chat_template or ByteTokenizer.CHAT_TEMPLATE
    else:
        info = {k: _token_content(v) for k, v in (getattr(tokenizer, "config", None) or {}).items() if k not in _DROPPED}
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        template = tokenizer.chat_template
    info["model_max_length"] = max_model_len
    if template:
        info["chat_template"] = template
    return info


def _token_content(value: Any) -> Any:
    """An AddedToken written as an object ({"content": "<s>", ...}) -> its text, as vLLM serialises it."""
    if isinstance(value, dict) and "content" in value and ("__type" in value or "special" in value):
        return value["content"]
    if isinstance(value, dict):
        return {k: _token_content(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_token_content(v) for v in value]
    return value
