"""Structured outputs: a grammar constrains which tokens a sequence may sample next.

xgrammar (the library vLLM and SGLang use) compiles a JSON schema, a regex, a list of choices or an
EBNF grammar against the tokenizer's vocabulary; a per-sequence matcher then fills a token bitmask
before each sample and advances by the sampled token. The mask is filled on the host (`fill_bitmasks`)
and applied on the device inside the batched sampler (`apply_bitmasks`), so constrained and free rows
share a step and the host reads nothing back. A spec that cannot compile is a 400
(`InvalidParameter` naming the request field), raised at admission, before any engine work.

`StructuredOutput` is plain data (it crosses processes under expert parallelism); each engine
compiles it against its own tokenizer, caching compiled grammars by spec.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from locus.engine.sampling.grammar_limits import GrammarLimits, check_spec
from locus.engine.sampling.params import InvalidParameter

KINDS = ("json", "json_object", "regex", "choice", "grammar")
JSON_KINDS = ("json", "json_object")
@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. kind: json (spec = a JSON schema, as text), json_object (any JSON
    object), regex, choice (spec = a JSON list of strings), grammar (EBNF, xgrammar/GBNF dialect).
    `param`: the request field it came from, for error messages."""

    kind: str
    spec: str = ""
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParameter(self.param, f"unknown structured output kind {self.kind!r} (choose {', '.join(KINDS)})")


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer and model vocabulary (logits width), keeping the
    most recently used compiled grammars up to `cache_bytes` of their memory (xgrammar's own cache is
    off: it never gave memory back). Thread-safe: the server compiles a new spec in a worker thread
    before admission (sampling/grammar_limits.py budgets that), the engine thread then finds it cached; no lock
    is held while compiling, so the engine never waits for another request's grammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, limits: GrammarLimits | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.limits = limits or GrammarLimits()
        self._compiler = None
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._cache_bytes = 0
        self._json_guard: JsonGuard | None = None
        self._lock = threading.Lock()
        self._prepare_lock = threading.Lock()  # held while the vocabulary is read: not the cache's lock

    def compile(self, so: StructuredOutput):
        with self._lock:
            if so in self._cache:
                self._cache.move_to_end(so)
                return self._cache[so]
        check_spec(so, self.limits)
        compiled = self._compile(so)
        with self._lock:
            if so not in self._cache:
                self._cache[so] = compiled
                self._cache_bytes += compiled.memory_size_bytes
            while self._cache_bytes > self.limits.cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= old.memory_size_bytes
        return compiled

    @property
    def cache_bytes(self) -> int:
        return self._cache_bytes

    @property
    def prepared(self) -> bool:
        return self._compiler is not None

    def prepare(self) -> None:
        """Import xgrammar and read the vocabulary into its compiler, once. A one-time cost of the
        server, not of a spec (about a second to import xgrammar here, seconds more for a 200k-token
        vocabulary): the server pays it before it times a request's compile against
        --max-grammar-compile-seconds, so the first constrained request is not refused for it."""
        if self._compiler is not None:  # every compile calls this: no import lookup or lock once prepared
            return
        import xgrammar as xgr

        with self._prepare_lock:
            if self._compiler is None:
                # one thread (the compile pools run one compile each), no cache of its own (ours is bounded)
                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.tokenizer, self.vocab_size), max_threads=1,
                                                     cache_enabled=False)

    def matcher(self, so: StructuredOutput):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(so))

    def json_guard(self) -> "JsonGuard":
        """What JSON-constrained rows must never sample, beyond the grammar (see JsonGuard)."""
        with self._lock:
            if self._json_guard is None:
                self._json_guard = JsonGuard.of(tokenizer_info(self.tokenizer, self.vocab_size).decoded_vocab)
            return self._json_guard

    def is_compiled(self, so: StructuredOutput) -> bool:
        with self._lock:
            return so in self._cache

    def check_satisfiable(self, so: StructuredOutput) -> None:
        """Refuse a constraint no output can meet: one that allows no first token (e.g. a regex that
        matches nothing, or a grammar whose only rule recurses forever)."""
        import xgrammar as xgr

        m = self.matcher(so)
        if m.is_terminated():
            return
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        m.fill_next_token_bitmask(bitmask, 0)
        if not bool((bitmask != 0).any()):
            raise InvalidParameter(so.param, f"the {so.kind} constraint accepts no output: no token can start it")

    def _compile(self, so: StructuredOutput):
        self.prepare()
        c = self._compiler
        try:
            if so.kind == "json":
                return c.compile_json_schema(so.spec, any_whitespace=False)
            if so.kind == "json_object":  # OpenAI's json_object is an object, not any JSON value
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if so.kind == "regex":
                return c.compile_regex(so.spec)
            if so.kind == "choice":
                choices = json.loads(so.spec)
                if not choices or not all(isinstance(x, str) for x in choices):
                    raise ValueError("choices must be a non-empty list of strings")
                return c.compile_regex("|".join(_regex_escape(x) for x in choices))
            return c.compile_grammar(so.spec)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types
            message = _clean(str(exc)) or type(exc).__name__
            raise InvalidParameter(so.param, f"the {so.kind} constraint does not compile: {message}") from None


def tokenizer_info(tokenizer: Any, vocab_size: int):
    """xgrammar's view of the vocabulary: each id's bytes, and the stop tokens."""
    import xgrammar as xgr

    stop = list(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "_tok", None)
    if hf is not None:  # a HuggingFace tokenizer.json: xgrammar reads its decoder (byte-level, byte-fallback)
        from transformers import PreTrainedTokenizerFast

        return xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=hf), vocab_size=vocab_size,
                                                  stop_token_ids=stop)
    # the byte tokenizer: ids 0..255 are bytes; special tokens match nothing but may stop
    vocab = [bytes([i]) for i in range(256)] + [b"" for _ in range(256, tokenizer.vocab_size)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop)


@dataclass(frozen=True)
class JsonGuard:
    """Two holes in xgrammar's JSON string rule, closed by masking (docs/serving.md, "Structured outputs
    and what is refused"):
    - raw bytes below 0x20 (under maxLength/minLength the rule lets them into strings; compact JSON never
      needs one outside a string either): those tokens are forbidden always;
    - UTF-16 surrogates encoded as UTF-8 (ED A0..BF ..): the rule accepts them, Python's UTF-8 does not,
      so the text would hold U+FFFD and break the schema's length: a token holding such a sequence is
      forbidden always, and after a token that ends in the lead byte ED, so is one starting A0..BF.
    Token ids are host arrays: the sampler folds them into the row's bitmask on the host."""

    always: np.ndarray  # int64 token ids never allowed
    ends_in_ed: frozenset  # token ids whose last byte is ED
    after_ed: np.ndarray  # int64 token ids starting with A0..BF

    @classmethod
    def of(cls, vocab: list[bytes]) -> "JsonGuard":
        always, ends, after = [], [], []
        for i, token in enumerate(vocab):
            token = bytes(token)
            if any(b < 0x20 for b in token) or re.search(rb"\xed[\xa0-\xbf]", token):
                always.append(i)
            if token.endswith(b"\xed"):
                ends.append(i)
            if token and 0xA0 <= token[0] <= 0xBF:
                after.append(i)
        return cls(np.array(always, dtype=np.int64), frozenset(ends), np.array(after, dtype=np.int64))

    def forbidden(self, output_ids: list[int]) -> np.ndarray:
        """The token ids a JSON row may not sample next, given its output so far."""
        if output_ids and output_ids[-1] in self.ends_in_ed:
            return np.concatenate([self.always, self.after_ed])
        return self.always


class ConstraintDeadEnd(RuntimeError):
    """A sequence's output constraint allows no token at this point: that request's fault alone."""


def fill_bitmasks(matchers: list, vocab: int, forbidden: list[np.ndarray]) -> np.ndarray:
    """[G, ceil(V / 32)] int32: bit t of row j set iff matchers[j] allows token t next and t is not in
    forbidden[j] (the row's stop tokens before min_tokens, its JsonGuard ids). Built on the host,
    where xgrammar's matchers live; bits past the vocabulary are clear, so a row of zeros is a row
    its constraint leaves no token."""
    words = np.full((len(matchers), (vocab + 31) // 32), -1, dtype=np.int32)
    view = torch.from_numpy(words)  # xgrammar fills a torch int32 tensor; this one shares `words`
    for j, m in enumerate(matchers):
        m.fill_next_token_bitmask(view, j)
    bits = words.view(np.uint32)
    for j, ids in enumerate(forbidden):
        ids = ids[(ids >= 0) & (ids < vocab)]
        if len(ids):
            np.bitwise_and.at(bits[j], ids >> 5, ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
    if vocab % 32:
        bits[:, -1] &= np.uint32((1 << (vocab % 32)) - 1)
    return words


def apply_bitmasks(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float; rows [G] int64 and words [G, W] int32 (fill_bitmasks), on the logits'
    device: a copy of logits with every token a row's bitmask clears at -inf. All on the device."""
    G, W = words.shape
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(G, W * 32)[:, :logits.shape[1]].bool()
    return logits.index_copy(0, rows, logits.index_select(0, rows).masked_fill(~allowed, -math.inf))


def _clean(message: str) -> str:
    """xgrammar's first line, without its C++ log prefix ("[time] file.cc:123: Check failed: ... is false: ")."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    line = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line)
    return re.sub(r"^Check failed: .*? is false: ", "", line)


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/" else ch for ch in text)
