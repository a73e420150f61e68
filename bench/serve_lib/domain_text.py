"""Domain-tagged prompts of real text for a trained model: held-out documents of its training corpus
(or the few the model ships in heldout_sample.json), cut to a number of the model's own tokens.

The random-weight presets route by byte alphabet, so their benches use synthetic prompt families
(locus/traces/prompt_families.py); a trained model routes by what it has learned, so its benches send
text of the domains it was trained on, which is where a locality plan's savings are real.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from serve_lib.common import BenchError


def domain_prompts(tok, corpus: str | None, sample_path: Path, per_domain: int, prompt_tokens: int) -> list[tuple[str, str]]:
    """(domain, prompt text) pairs, per_domain a domain at most, in domain-interleaved order."""
    if corpus:
        from locus.training.corpus import read_corpus

        docs: dict[str, list[str]] = {}
        for d in read_corpus(corpus):
            if d["split"] == "heldout":
                docs.setdefault(d["domain"], []).append(d["text"])
    else:
        docs = json.loads(sample_path.read_text())["documents"]
    prompts: dict[str, list[str]] = {}
    for domain, texts in docs.items():
        out = prompts.setdefault(domain, [])
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False).ids
            # a long document (code) gives several prompts; a short one (a fortune) one
            for start in range(0, max(1, len(ids) - prompt_tokens // 2), prompt_tokens):
                piece = ids[start:start + prompt_tokens]
                if len(piece) >= 8 and len(out) < per_domain:
                    out.append(tok.decode(piece))
    order = []
    for i in range(per_domain):
        order.extend((domain, p[i]) for domain, p in prompts.items() if i < len(p))
    return order


@dataclass
class DomainText:
    """Two disjoint pools of prompts per domain: one the planning trace is recorded from, one the
    measured workload is sent from (the plan never sees the text it is measured on)."""

    planning: dict[str, list[str]]
    measured: dict[str, list[str]]
    source: str  # what the prompts were cut from, for the bench's header

    @classmethod
    def load(cls, model_dir: Path, corpus: str | None, prompt_tokens: int, per_domain: int = 1000) -> "DomainText":
        from locus.training.tokenizer import load_trained

        sample = model_dir / "heldout_sample.json"
        if not corpus and not sample.is_file():
            raise BenchError(f"{model_dir} ships no heldout_sample.json and no --corpus was given: "
                             f"text prompts need one of them (or use --prompts families)")
        tok = load_trained(model_dir / "tokenizer.json")
        by_domain: dict[str, list[str]] = {}
        for domain, text in domain_prompts(tok, corpus, sample, per_domain, prompt_tokens):
            by_domain.setdefault(domain, []).append(text)
        # a domain needs a prompt in each pool
        by_domain = {d: p for d, p in by_domain.items() if len(p) >= 2}
        if not by_domain:
            raise BenchError(f"no domain of {corpus or sample} gives two prompts of {prompt_tokens} tokens")
        return cls({d: p[0::2] for d, p in by_domain.items()}, {d: p[1::2] for d, p in by_domain.items()},
                   f"{corpus or sample}: {', '.join(f'{d} {len(p)}' for d, p in by_domain.items())} prompts of "
                   f"<= {prompt_tokens} tokens")

    def take(self, count: int, offset: int, planning: bool = False) -> list[tuple[str, str]]:
        """(domain, prompt) of requests offset .. offset + count: the domains in turn, each domain's
        prompts in order (wrapping around a pool once it is used up)."""
        pools = self.planning if planning else self.measured
        domains = list(pools)
        out = []
        for k in range(offset, offset + count):
            domain = domains[k % len(domains)]
            out.append((domain, pools[domain][(k // len(domains)) % len(pools[domain])]))
        return out
