"""Predict where a prompt's tokens will route, before its prefill runs, from its token ids alone.

Two tables, learned from the planning trace's rows and their token ids (token_ids.npy), kept for the
`max_tokens` most frequent token ids of the planning rows:

- **Token-expert affinity** (every plan learned from such a trace): per table token and MoE layer, the
  share of its (token, k) pairs each expert received. A prompt's predicted signature is the sum of its
  tokens' rows, times top-k: its expected prefill pair counts [L, E], which the grouper's cost model
  (node_cost.py) turns into a cost per node. Tokens not in the table add nothing (the cost model
  shrinks a signature towards the planning popularity anyway).
- **Domain classifier** (when the planning requests carry domain tags): multinomial naive Bayes over
  the prompt's token ids (Laplace-smoothed counts of each domain's prompt tokens, a token outside the
  table scored as an unseen one), so that an untagged request is placed as the tag the plan was made
  for would place it. `classify` gives the most likely tagged domain when its posterior probability
  is at least MIN_CONFIDENCE (0.8); a less certain prompt is left to the affinity table.

Bounded: at most `max_tokens` token ids, each with its `top_experts` largest shares per layer (the rest
of its pairs are dropped) and one log-probability per domain, so a plan for a 200k-token vocabulary and
128 experts stays a few MB. Stored in the plan's `grouping.predictor` (docs/planner.md) as little-endian
arrays in base64:

    {"kind": "token-affinity", "vocab_size": V, "num_experts": E, "moe_layers": [...], "top_k": K,
     "tokens": N, "top_experts": M,
     "token_ids": b64 int32 [N] (increasing), "experts": b64 int16 [N, L, M] (-1: none),
     "shares": b64 uint16 [N, L, M] (share * 65535),
     "domains": [D names],                                         // optional: the classifier
     "domain_log_prior": [D], "domain_log_unseen": [D], "domain_log_probs": b64 float32 [N, D]}

A table only means something for the model and tokenizer it was learned on: `check_model` refuses one
whose vocabulary, MoE layers or expert count differ from the model's, naming the difference.

Shape legend: V vocabulary, N table tokens, L MoE layers, E experts, M experts kept per (token, layer),
D domains, B prompts, T rows.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from locus.errors import LocusError
from locus.routing.plan.placement import PlanError
from locus.traces.reader import CHUNK_ROUTINGS

KIND = "token-affinity"
DEFAULT_TOKENS = 4096
DEFAULT_TOP_EXPERTS = 8
MIN_COUNT = 2  # a token seen once says more about its context than about itself
# The classifier names a domain only at this posterior probability or more; a less certain prompt is
# placed by its predicted node cost instead (what a wrong domain costs is a whole node of bytes).
MIN_CONFIDENCE = 0.8
SHARE_SCALE = 65535


@dataclass(frozen=True)
class TokenAffinity:
    vocab_size: int
    num_experts: int
    moe_layers: tuple[int, ...]
    top_k: int
    token_ids: np.ndarray  # [N] int64, increasing
    experts: np.ndarray  # [N, L, M] int64, -1 = none
    shares: np.ndarray  # [N, L, M] float32, each (token, layer) row sums to <= 1
    domains: tuple[str, ...] = ()  # the classifier's domains (none: no classifier)
    domain_log_prior: np.ndarray | None = None  # [D] log share of the planning requests
    domain_log_unseen: np.ndarray | None = None  # [D] log-probability of a token outside the table
    domain_log_probs: np.ndarray | None = None  # [N, D] float32 log P(token | domain)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    # --- learning ------------------------------------------------------------------------------------
    @classmethod
    def learn(cls, reader, start: int, stop: int, max_tokens: int = DEFAULT_TOKENS,
              top_experts: int = DEFAULT_TOP_EXPERTS) -> "TokenAffinity":
        """From the rows of requests [start, stop) of a trace with token ids."""
        meta = reader.meta
        if reader.token_ids is None:
            raise LocusError(f"{reader.path}: the trace has no token ids (token_ids.npy), so no prompt predictor can "
                             "be learned from it; record it with this Locus (`locus serve --record-trace`)")
        if meta.vocab_size is None:
            raise LocusError(f"{reader.path}: meta.json has no vocab_size; a prompt predictor needs the model's vocabulary")
        if max_tokens < 1 or top_experts < 1:
            raise LocusError(f"the predictor needs at least one token and one expert per token "
                             f"(got {max_tokens} tokens, {top_experts} experts)")
        V, L, E, K = meta.vocab_size, len(meta.moe_layers), meta.num_experts, meta.top_k
        lo, hi = int(reader.offsets[start]), int(reader.offsets[stop])
        tokens = np.asarray(reader.token_ids[lo:hi], dtype=np.int64)
        freq = np.bincount(tokens, minlength=V)
        kept = np.flatnonzero(freq >= MIN_COUNT)
        kept = kept[np.argsort(-freq[kept], kind="stable")[:max_tokens]]
        kept.sort()
        row_of = np.full(V, -1, dtype=np.int64)
        row_of[kept] = np.arange(len(kept))
        N = len(kept)
        counts = np.zeros((N, L, E), dtype=np.float64)
        step = max(1, CHUNK_ROUTINGS // (L * K))
        for a in range(lo, hi, step):
            b = min(a + step, hi)
            rows = row_of[np.asarray(reader.token_ids[a:b], dtype=np.int64)]
            ids = np.asarray(reader.read_rows(a, b), dtype=np.int64)  # [T, L, K]
            for layer in range(L):
                sel = (rows[:, None] >= 0) & (ids[:, layer] >= 0)  # [T, K]
                keys = np.broadcast_to(rows[:, None], sel.shape)[sel] * E + ids[:, layer][sel]
                counts[:, layer] += np.bincount(keys, minlength=N * E).reshape(N, E)
        M = min(top_experts, E)
        share = counts / np.maximum(counts.sum(-1, keepdims=True), 1.0)  # [N, L, E]
        order = np.argsort(-share, axis=-1, kind="stable")[..., :M]  # [N, L, M]
        top = np.take_along_axis(share, order, -1)
        experts = np.where(top > 0, order, -1)
        classifier = _learn_classifier(reader, start, stop, row_of)
        return cls(V, E, tuple(meta.moe_layers), K, kept.astype(np.int64), experts.astype(np.int64),
                   top.astype(np.float32), *classifier)

    # --- predicting ----------------------------------------------------------------------------------
    def signature(self, prompt_ids) -> np.ndarray:
        """Predicted prefill pair counts [L, E] of one prompt (token ids)."""
        return self.signatures([prompt_ids])[0]

    def signatures(self, prompts) -> np.ndarray:
        """Predicted prefill pair counts [B, L, E] of several prompts (each a sequence of token ids)."""
        L, E = len(self.moe_layers), self.num_experts
        out = np.zeros((len(prompts), L * E), dtype=np.float64)
        lengths = [len(p) for p in prompts]
        if not sum(lengths):
            return out.reshape(-1, L, E).astype(np.float32)
        ids = np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts])
        owner = np.repeat(np.arange(len(prompts)), lengths)
        pos = np.searchsorted(self.token_ids, ids)
        known = (pos < self.num_tokens) & (self.token_ids[np.minimum(pos, self.num_tokens - 1)] == ids)
        rows, owner = pos[known], owner[known]
        experts, shares = self.experts[rows], self.shares[rows]  # [T, L, M]
        valid = experts >= 0
        col = np.arange(L)[None, :, None] * E + experts  # [T, L, M]
        flat = owner[:, None, None] * (L * E) + col
        np.add.at(out.reshape(-1), flat[valid], shares[valid].astype(np.float64) * self.top_k)
        return out.reshape(-1, L, E).astype(np.float32)

    def classify(self, prompt_ids, confidence: float = MIN_CONFIDENCE) -> str | None:
        """The most likely tagged domain of a prompt (ties: the first in name order), if its posterior
        probability reaches `confidence`; None below it, without a classifier or for an empty prompt."""
        if not self.domains or len(prompt_ids) == 0:
            return None
        ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        pos = np.searchsorted(self.token_ids, ids)
        known = (pos < self.num_tokens) & (self.token_ids[np.minimum(pos, self.num_tokens - 1)] == ids)
        score = (self.domain_log_prior + self.domain_log_probs[pos[known]].sum(0, dtype=np.float64)
                 + (len(ids) - int(known.sum())) * self.domain_log_unseen)
        best = int(np.argmax(score))
        posterior = 1.0 / np.exp(score - score[best]).sum()
        return self.domains[best] if posterior >= confidence else None

    # --- checks and storage ----------------------------------------------------------------------------
    def check_model(self, vocab_size: int, moe_layers, num_experts: int, what: str = "the model") -> None:
        """Refuse a table learned for another model: vocabulary, MoE layers, experts."""
        problems = []
        if int(vocab_size) != self.vocab_size:
            problems.append(f"a vocabulary of {self.vocab_size} tokens, {what} has {vocab_size}")
        if tuple(int(x) for x in moe_layers) != self.moe_layers:
            problems.append(f"MoE layers {list(self.moe_layers)}, {what} has {list(moe_layers)}")
        if int(num_experts) != self.num_experts:
            problems.append(f"{self.num_experts} experts, {what} has {num_experts}")
        if problems:
            raise LocusError("the plan's prompt predictor (grouping.predictor) was learned for " + "; ".join(problems)
                             + ": re-plan from a trace of this model (`locus plan --predictor-tokens`), or use a plan "
                             "without a predictor")

    def to_dict(self) -> dict:
        N, L, M = self.experts.shape
        out = {"kind": KIND, "vocab_size": self.vocab_size, "num_experts": self.num_experts,
               "moe_layers": list(self.moe_layers), "top_k": self.top_k, "tokens": N, "top_experts": M,
               "token_ids": _b64(self.token_ids.astype("<i4")), "experts": _b64(self.experts.astype("<i2")),
               "shares": _b64(np.round(self.shares * SHARE_SCALE).astype("<u2"))}
        if self.domains:
            out.update(domains=list(self.domains), domain_log_prior=[float(x) for x in self.domain_log_prior],
                       domain_log_unseen=[float(x) for x in self.domain_log_unseen],
                       domain_log_probs=_b64(self.domain_log_probs.astype("<f4")))
        return out

    @classmethod
    def from_dict(cls, data: object, moe_layers, num_experts: int) -> "TokenAffinity":
        """Parse `grouping.predictor`, checked against the plan's layers and experts; errors name the field."""
        where = "grouping.predictor"
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise PlanError(f"{where} must be an object with \"kind\": \"{KIND}\"")
        for key in ("vocab_size", "num_experts", "top_k", "tokens", "top_experts"):
            least = 0 if key == "tokens" else 1
            if not isinstance(data.get(key), int) or isinstance(data.get(key), bool) or data[key] < least:
                raise PlanError(f"{where}.{key} must be an integer >= {least}, got {data.get(key)!r}")
        layers = data.get("moe_layers")
        if not isinstance(layers, list) or tuple(layers) != tuple(int(x) for x in moe_layers):
            raise PlanError(f"{where}.moe_layers {layers!r} differ from the plan's {list(moe_layers)}")
        if data["num_experts"] != num_experts:
            raise PlanError(f"{where}.num_experts {data['num_experts']} differs from the plan's {num_experts}")
        N, L, M = data["tokens"], len(layers), data["top_experts"]
        token_ids = _unb64(data, "token_ids", "<i4", (N,)).astype(np.int64)
        experts = _unb64(data, "experts", "<i2", (N, L, M)).astype(np.int64)
        shares = _unb64(data, "shares", "<u2", (N, L, M)).astype(np.float32) / SHARE_SCALE
        if N and (token_ids[0] < 0 or token_ids[-1] >= data["vocab_size"] or (np.diff(token_ids) <= 0).any()):
            raise PlanError(f"{where}.token_ids must be increasing ids in 0..{data['vocab_size'] - 1}")
        if ((experts < -1) | (experts >= num_experts)).any():
            raise PlanError(f"{where}.experts must be expert ids in -1..{num_experts - 1}")
        if (shares.sum(-1) > 1.0 + M / SHARE_SCALE).any():
            raise PlanError(f"{where}.shares of one token and layer must sum to at most 1")
        classifier = ((), None, None, None)
        if data.get("domains") is not None:
            domains = data["domains"]
            if not isinstance(domains, list) or not domains or not all(isinstance(d, str) and d for d in domains) \
                    or len(set(domains)) != len(domains):
                raise PlanError(f"{where}.domains must list distinct non-empty domain names")
            D = len(domains)
            vectors = []
            for key in ("domain_log_prior", "domain_log_unseen"):
                try:
                    v = np.asarray(data.get(key), dtype=np.float64)
                except (TypeError, ValueError):
                    v = np.zeros(0)
                if v.shape != (D,) or not np.isfinite(v).all() or (v > 0).any():
                    raise PlanError(f"{where}.{key} must list {D} log-probabilities (finite, <= 0)")
                vectors.append(v)
            log_probs = _unb64(data, "domain_log_probs", "<f4", (N, D)).astype(np.float32)
            if not np.isfinite(log_probs).all() or (log_probs > 0).any():
                raise PlanError(f"{where}.domain_log_probs must be log-probabilities (finite, <= 0)")
            classifier = (tuple(domains), vectors[0], vectors[1], log_probs)
        return cls(data["vocab_size"], num_experts, tuple(int(x) for x in layers), data["top_k"], token_ids, experts,
                   np.where(experts >= 0, shares, 0.0).astype(np.float32), *classifier)


def _learn_classifier(reader, start: int, stop: int, row_of: np.ndarray):
    """Naive Bayes over the prompt tokens of the tagged requests [start, stop): (domains, log prior [D],
    log-probability of a token outside the table [D], log P(token | domain) [N, D]); empty without tags."""
    requests = reader.requests[start:stop]
    domains = tuple(sorted({r.domain for r in requests if r.domain}))
    if not domains:
        return (), None, None, None
    V, D = len(row_of), len(domains)
    index = {d: i for i, d in enumerate(domains)}
    counts = np.zeros((D, V), dtype=np.float64)
    requests_of = np.zeros(D)
    offsets = reader.offsets
    for j, r in enumerate(requests):
        if not r.domain:
            continue
        lo = int(offsets[start + j])
        d = index[r.domain]
        counts[d] += np.bincount(np.asarray(reader.token_ids[lo : lo + r.prompt_tokens], dtype=np.int64), minlength=V)
        requests_of[d] += 1
    total = counts.sum(1) + V  # Laplace: one pseudo-count per vocabulary token
    kept = row_of >= 0  # the table's tokens, in increasing id order: its row order
    log_probs = np.log((counts[:, kept] + 1.0) / total[:, None])  # [D, N]
    log_prior = np.log(requests_of / requests_of.sum())
    return domains, log_prior, np.log(1.0 / total), log_probs.T.astype(np.float32)


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")


def _unb64(data: dict, key: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    where = f"grouping.predictor.{key}"
    text = data.get(key)
    if not isinstance(text, str):
        raise PlanError(f"{where} must be a base64 string")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise PlanError(f"{where} is not valid base64") from None
    want = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if len(raw) != want:
        raise PlanError(f"{where} holds {len(raw)} bytes, {list(shape)} {np.dtype(dtype).name} needs {want}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)
