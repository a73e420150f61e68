"""Incremental detokenization: a growing list of output token ids -> text deltas, and stop strings.

Why a window and not one token at a time: a token's text depends on its neighbours. Byte-level BPE
pieces and raw byte tokens can split one character over several tokens (decoding the head alone gives
U+FFFD), and SentencePiece-style decoders drop a word's leading space at the start of a decode. So each
step decodes a short window twice, `ids[prefix:read]` (text already emitted) and `ids[prefix:]`, and the
new text is the difference; the window slides only once the new text is complete (no trailing
U+FFFD), which keeps the cost per token constant. The window starts on the prompt's last few tokens,
so the first output token is decoded in context: the text is the continuation of the prompt (what
OpenAI completions return), which equals decode(output ids) for byte-level tokenizers.

Why hold back: a stop string may arrive over several tokens, and no part of it may ever reach the
client. Text that could still be the start of a stop string (the longest suffix of the decoded text
that is a proper prefix of one) is held until the next token settles it, or until `flush`.

The token that ends a sequence (EOS or one of stop_token_ids) should not be passed to `add`, as in
vLLM, unless its text is wanted in the output; then call `flush`.
"""

from __future__ import annotations

from dataclasses import dataclass

from locus.engine.sampling import SamplingParams
from locus.engine.checkpoint.tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens decoded ahead of the output, for context-dependent decoders
INCOMPLETE = "\ufffd"  # what decoders produce for a character whose bytes have not all arrived


@dataclass
class DetokenizerStep:
    text_delta: str
    stop_string: str | None = None  # the stop string that ended the text, if one did


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0  # window start: context for the decoder
        self._read = len(self._ids)  # tokens before this are already in `_decoded`
        self._decoded = ""  # output text decoded so far (complete characters only)
        self.text = ""  # output text emitted so far: `_decoded` less what is held back
        self.stop_string: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add(self, token_id: int) -> DetokenizerStep:
        """Take the newest output token; once a stop string has matched, further tokens are ignored."""
        if self.stopped:
            return DetokenizerStep("")
        self._ids.append(token_id)
        self._decoded += self._decode_window(final=False)
        return self._emit(final=False)

    def flush(self) -> str:
        """At a finish other than a stop string: everything still held back, incomplete bytes included."""
        if self.stopped:
            return ""
        self._decoded += self._decode_window(final=True)
        return self._emit(final=True).text_delta

    def _decode_window(self, final: bool) -> str:
        done = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(done) or (full.endswith(INCOMPLETE) and not final):
            return ""  # nothing new, or a character still waiting for its remaining bytes
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(done):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""

    def _emit(self, final: bool) -> DetokenizerStep:
        # Held-back text never contains a whole stop string, so a match starts at or after len(text).
        match = find_stop(self._decoded, self._stops, start=len(self.text))
        if match is not None:
            at, stop = match
            end = at + len(stop) if self._include_stop else at
            delta = self._decoded[len(self.text):end]
            self.text += delta
            self.stop_string = stop
            return DetokenizerStep(delta, stop)
        safe = len(self._decoded) if final else len(self._decoded) - partial_stop_length(self._decoded, self._stops)
        delta = self._decoded[len(self.text):max(safe, len(self.text))]
        self.text += delta
        return DetokenizerStep(delta)


def find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """The stop string that completes first in text[start:]: (where it starts, which one)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
            best = (at + len(stop), at, stop)
    return None if best is None else (best[1], best[2])


def partial_stop_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
