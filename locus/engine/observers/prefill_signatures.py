"""Each request's prefill signature: its prompt's (MoE layer, expert) pair counts, handed out once the
whole prompt has run. What an expert-parallel rank reports to rank 0, whose grouper decides from it
whether the request moves to another rank for its decode (docs/planner.md, "Moving a request after
prefill"). The counts are those of the prompt rows a recorded trace holds, so the replay's grouper
sees the same signature.

Shape legend: L MoE layers (the model's order), E experts.
"""

from __future__ import annotations

import numpy as np

from locus.engine.observers.routing_tap import StepRouting


class PrefillSignatures:
    """A routing-tap subscriber; `drain` returns the signatures completed since the last call."""

    def __init__(self, num_layers: int, num_experts: int):
        self.L, self.E = num_layers, num_experts
        self._partial: dict[int, tuple[str, int, np.ndarray]] = {}  # seq id -> (request id, positions seen, counts)
        self._ready: list[tuple[str, np.ndarray, np.ndarray]] = []
        self._done: set[str] = set()  # requests handed out (a recompute after preemption is not counted again)

    def __call__(self, step: StepRouting) -> None:
        for item, (span, lo, hi) in zip(step.items, step.rows):
            seq = item.seq
            if seq.index != 0:
                continue
            request = seq.request
            prompt = len(request.prompt_ids)
            entry = self._partial.get(seq.seq_id)
            if entry is None:
                if span.start != 0 or request.request_id in self._done:
                    continue  # seen from its first position only (a moved-in sequence is not)
                entry = (request.request_id, 0, np.zeros(self.L * self.E, dtype=np.int64))
            request_id, seen, counts = entry
            first, last = max(seen, span.start), min(span.end, prompt)
            if last > first:
                ids = np.asarray(step.ids[lo + first - span.start : lo + last - span.start], dtype=np.int64)  # [t, L, K]
                keys = np.arange(self.L)[None, :, None] * self.E + ids
                np.add.at(counts, keys[ids >= 0], 1)
            seen = max(seen, min(span.end, prompt))
            if seen >= prompt:
                self._partial.pop(seq.seq_id, None)
                self._done.add(request_id)
                index = np.flatnonzero(counts)
                self._ready.append((request_id, index.astype(np.int32), counts[index]))
            else:
                self._partial[seq.seq_id] = (request_id, seen, counts)

    def drain(self, live: set[str] | dict | None = None) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """The completed signatures, sparse: (request id, flat layer * E + expert index, count). `live`:
        the requests still in the engine (the others are forgotten)."""
        out, self._ready = self._ready, []
        if live is not None:
            self._done = {r for r in self._done if r in live}
            self._partial = {k: v for k, v in self._partial.items() if v[0] in live}
        return out

    def dense(self, index: np.ndarray, count: np.ndarray) -> np.ndarray:
        """A sparse signature as [L, E] counts."""
        out = np.zeros(self.L * self.E, dtype=np.int64)
        out[np.asarray(index, dtype=np.int64)] = count
        return out.reshape(self.L, self.E)
