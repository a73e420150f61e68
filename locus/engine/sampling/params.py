"""Sampling parameters: what a request may ask of the sampler, with the ranges OpenAI and vLLM allow.

The checks come in two halves, each run once per request: `check_ranges` (no model needed) where the
request enters (the server's protocol layer, `locus generate`; `EngineCore.validate` for params an
offline caller built itself), and `check_vocab` (the token-valued fields against the model's
vocabulary) in `EngineCore.validate`. The server maps their failures (`InvalidParameter`, which names
the field) onto OpenAI 400 errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from locus.errors import LocusError

GREEDY_EPS = 1e-5  # a temperature below this is greedy (dividing by it would overflow)
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's: -100 all but bans a token, 100 all but forces it
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class InvalidParameter(LocusError):
    """A request field out of range; `param` is the field's name, for OpenAI's error `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens
    presence_penalty: float = 0.0  # over output tokens
    frequency_penalty: float = 0.0  # over output tokens
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context limit; 0 (with prompt_logprobs) = score the prompt only
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives besides the sampled token's own logprob
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: Any = None  # a StructuredOutput (sampling/grammar.py): the grammar the output must match
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (greedy too)
    # Set by check_ranges and cleared by any later change of a field, so a holder of params with it set
    # knows the ranges hold without checking them again (a copy made with every field carries it).
    ranges_checked: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Requests carry lists (JSON) and OpenAI allows `stop` as one string; store tuples. The same
        # values in another container: not a change that voids ranges_checked.
        object.__setattr__(self, "stop", self.normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))

    def __setattr__(self, name: str, value: object) -> None:
        if name != "ranges_checked" and self.__dict__.get("ranges_checked"):
            object.__setattr__(self, "ranges_checked", False)  # the checked values are gone
        object.__setattr__(self, name, value)

    @staticmethod
    def normalize_stop(stop: str | Iterable[str] | None) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            return (stop,)
        return tuple(stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def generates(self) -> bool:
        """False for a request that only scores its prompt (max_tokens 0): it never samples."""
        return self.max_tokens != 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Both halves at once (ranges, then with `vocab_size` the vocabulary bounds): for a caller
        that holds the vocabulary size and no engine."""
        self.check_ranges()
        if vocab_size is not None:
            self.check_vocab(vocab_size)

    def check_ranges(self) -> None:
        """Raise InvalidParameter on the first field outside the range OpenAI / vLLM accept; needs no
        model. Marks the params `ranges_checked`."""
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, 2.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, -1, None)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, *SEED_RANGE)
        if self.max_tokens is not None:  # 0 only for a request that scores its prompt (else it asks for nothing)
            _check_int("max_tokens", self.max_tokens, 0 if self.prompt_logprobs is not None else 1, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameter("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParameter("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidParameter("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, None)
        if self.logit_bias is not None:
            self._check_logit_bias()
        self.ranges_checked = True

    def check_vocab(self, vocab_size: int) -> None:
        """Raise InvalidParameter on the first token-valued field (top_k, stop_token_ids, logit_bias's
        ids) past the model's vocabulary. Takes params whose ranges hold (`check_ranges`): it checks
        only the upper bounds the ranges leave open."""
        if self.top_k > vocab_size:
            raise InvalidParameter("top_k", f"top_k must be -1 or 0 (off), or in [1, {vocab_size}] (the vocabulary "
                                            f"size), got {self.top_k}")
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidParameter("stop_token_ids", f"stop_token_ids must be in [0, {vocab_size - 1}], got {t}")
        for token in self.logit_bias or ():
            if token >= vocab_size:
                raise InvalidParameter("logit_bias", f"logit_bias token id {token!r} is outside the vocabulary "
                                                     f"(0..{vocab_size - 1})")

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise InvalidParameter("logit_bias", "logit_bias must map token ids to numbers")
        low, high = LOGIT_BIAS_RANGE
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidParameter("logit_bias", f"logit_bias token id {token!r} is outside the vocabulary")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not low <= bias <= high:
                raise InvalidParameter("logit_bias", f"logit_bias values must be numbers in [{low:g}, {high:g}]; "
                                                     f"token {token} has {bias!r}")


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(name, f"{name} must be an integer, got {value!r}")
    if name == "top_k" and value == 0:
        return
    if value < low or (high is not None and value > high):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        if name == "top_k":
            allowed = "-1 or 0 (off), or " + (">= 1" if high is None else f"in [1, {high}] (the vocabulary size)")
        raise InvalidParameter(name, f"{name} must be {allowed}, got {value}")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(name, f"{name} must be a number, got {value!r}")
    # NaN fails both comparisons, so it is rejected too
    if not ((value > low if low_open else value >= low) and value <= high):
        raise InvalidParameter(name, f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value}")
