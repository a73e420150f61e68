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

Why a streaming matcher: a client chooses the stop strings, so their length is the client's. Looking
for them (and for the held-back prefix) in the decoded text anew at every token costs O(stop
length^2) per token (docs/serving.md, "Request limits"). `StopScanner` runs one Knuth-Morris-Pratt
automaton per stop string over each new character once, so a whole generation costs O(output + stop
text): the automaton's state after each character is exactly the length of the held-back prefix, and
reaching the stop string's length is a match. Only the held-back text is kept besides the emitted
pieces.

The token that ends a sequence (EOS or one of stop_token_ids) should not be passed to `add`, as in
vLLM, unless its text is wanted in the output; then call `flush`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from locus.engine.sampling.sampler import SamplingParams
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
        self._scanner = StopScanner(params.stop) if params.stop else None
        self._include_stop = params.include_stop_str_in_output
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0  # window start: context for the decoder
        self._read = len(self._ids)  # tokens before this are already decoded
        self._held = ""  # decoded text not emitted yet: it could still be the start of a stop string
        self._pieces: list[str] = []  # the emitted text, joined only when read (appending to one str copies it)
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """The output text emitted so far: the decoded text less what is held back."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add(self, token_id: int) -> DetokenizerStep:
        """Take the newest output token; once a stop string has matched, further tokens are ignored."""
        if self.stopped:
            return DetokenizerStep("")
        self._ids.append(token_id)
        return self._emit(self._decode_window(final=False), final=False)

    def flush(self) -> str:
        """At a finish other than a stop string: everything still held back, incomplete bytes included."""
        if self.stopped:
            return ""
        return self._emit(self._decode_window(final=True), final=True).text_delta

    def _decode_window(self, final: bool) -> str:
        done = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) <= len(done) or (full.endswith(INCOMPLETE) and not final):
            return ""  # nothing new, or a character still waiting for its remaining bytes
        self._prefix, self._read = self._read, len(self._ids)
        return full[len(done):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""

    def _emit(self, new: str, final: bool) -> DetokenizerStep:
        held = self._held + new
        keep = 0
        if self._scanner is not None:
            # Held-back text never contains a whole stop string, so a match starts inside `held`.
            match = self._scanner.feed(new)
            if match is not None:
                end, stop = match
                at = len(self._held) + end - len(stop)
                delta = held[:at + len(stop) if self._include_stop else at]
                self._held = ""
                self.stop_string = stop
                return self._out(delta, stop)
            keep = 0 if final else min(self._scanner.partial, len(held))
        self._held = held[len(held) - keep:] if keep else ""
        return self._out(held[:len(held) - keep], None)

    def _out(self, delta: str, stop: str | None) -> DetokenizerStep:
        if delta:
            self._pieces.append(delta)
        return DetokenizerStep(delta, stop)


class StopScanner:
    """Every stop string's Knuth-Morris-Pratt automaton, fed the decoded text once, character by
    character. State q of a stop string = the length of the longest suffix of the text so far that is
    a prefix of it; q reaching its length is a match. Cost: O(characters fed) over a whole sequence
    (each character raises q by at most one, and every fall-back lowers it), plus O(stop length) to
    build the tables, which identical stop strings share (`failure_table`'s cache; n > 1 forks)."""

    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._tables = [failure_table(stop) for stop in stops]
        self._states = [0] * len(stops)

    @property
    def partial(self) -> int:
        """The longest suffix of the text fed so far that is a proper prefix of a stop string."""
        return max(self._states)

    def feed(self, text: str) -> tuple[int, str] | None:
        """Advance over `text`; the stop string that completes first in it, as (the index in `text`
        just past its end, the stop string), the longer one where two end together; else None."""
        best: tuple[int, int, str] | None = None
        for i, stop in enumerate(self._stops):
            state, end = _advance(stop, self._tables[i], self._states[i], text)
            self._states[i] = state
            if end is not None and (best is None or (end, -len(stop)) < best[:2]):
                best = (end, -len(stop), stop)
        return None if best is None else (best[0], best[2])


@lru_cache(maxsize=64)
def failure_table(stop: str) -> list[int]:
    """KMP's failure function: table[i] = the length of the longest proper prefix of stop[:i + 1]
    that is also its suffix. (Shared between callers: never modify the list.)"""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        c = stop[i]
        while k and stop[k] != c:
            k = table[k - 1]
        if stop[k] == c:
            k += 1
        table[i] = k
    return table


def _advance(stop: str, table: list[int], q: int, text: str) -> tuple[int, int | None]:
    """One stop string's automaton from state q over `text`: (the new state, the index just past the
    first match, or None). In state 0 the scan jumps to the next occurrence of the stop string's first
    character (str.find, in C): most output never starts a stop string."""
    n, first, i, end = len(stop), stop[0], 0, len(text)
    while i < end:
        if q == 0:
            i = text.find(first, i)
            if i < 0:
                return 0, None
            q = 1
        else:
            c = text[i]
            while q and stop[q] != c:
                q = table[q - 1]
            if stop[q] == c:
                q += 1
        i += 1
        if q == n:
            return q, i
    return q, None


# The definitions the streaming scanner implements, over a whole text at once (tests compare the two).

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
