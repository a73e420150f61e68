"""Structured outputs: a grammar constrains which tokens a sequence may sample next.

xgrammar (the library vLLM and SGLang use) compiles a JSON schema, a regex, a list of choices or an
EBNF grammar against the tokenizer's vocabulary; a per-sequence matcher then fills a token bitmask
before each sample and advances by the sampled token. The mask is applied inside the batched sampler
(`Sampler.sample`), so constrained and free rows share a step. A spec that cannot compile is a 400
(`InvalidParameter` naming the request field), raised at admission, before any engine work.

`StructuredOutput` is plain data (it crosses processes under expert parallelism); each engine
compiles it against its own tokenizer, caching compiled grammars by spec.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from locus.engine.sampling_params import InvalidParameter

KINDS = ("json", "json_object", "regex", "choice", "grammar")


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
    most recent CACHE_SIZE compiled grammars. Thread-safe: the server compiles a new spec in a worker
    thread before admission, the engine thread then finds it cached; no lock is held while compiling,
    so the engine never waits for another request's grammar."""

    CACHE_SIZE = 256

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler = None
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutput):
        with self._lock:
            if so in self._cache:
                self._cache.move_to_end(so)
                return self._cache[so]
        compiled = self._compile(so)
        with self._lock:
            self._cache[so] = compiled
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, so: StructuredOutput):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(so))

    def _compile(self, so: StructuredOutput):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:  # the vocabulary is read once (seconds for a 200k-token one)
                self._compiler = xgr.GrammarCompiler(tokenizer_info(self.tokenizer, self.vocab_size))
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


def apply_grammar_masks(logits: torch.Tensor, matchers: list) -> torch.Tensor:
    """logits [B, V]; matchers[i] None (free row) or row i's matcher: forbid what its grammar forbids."""
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(len(matchers), logits.shape[1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    logits = logits.clone()  # the caller's tensor may be the model's logits, still needed on a retry
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    return logits


def _clean(message: str) -> str:
    """xgrammar's first line, without its C++ log prefix ("[time] file.cc:123: Check failed: ... is false: ")."""
    line = message.strip().splitlines()[0] if message.strip() else ""
    line = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line)
    return re.sub(r"^Check failed: .*? is false: ", "", line)


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/" else ch for ch in text)
