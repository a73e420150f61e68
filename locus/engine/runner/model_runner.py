"""Model runner: turns one scheduled micro-batch into a forward pass over the paged KV cache.

It computes logits only for the sequences that sample this step (those whose every token is now
computed, unless the request only scores its prompt: max_tokens 0): the middle chunks of a long
prefill need no lm_head. The one exception: a request that
asked for prompt logprobs gets logits for the prompt positions this step computes that it has not
scored yet (each position predicts the next prompt token). The sampled rows' greedy token (each
row's argmax) is computed with the logits, on the device, as the decode graphs do.

A decode row whose newest token is still on the device (`Sequence.in_flight`, the overlapped
schedule) gets a placeholder from the host; the device copies the token in from the previous step's
sampled ids (`Feed`) before the forward reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from locus.engine.runner.decode_graph import DecodeGraphs
from locus.engine.host_transfer import to_device
from locus.engine.model.forward_batch import ForwardBatch, SequenceSpan
from locus.engine.requests.sequence import ScheduledSeq, Sequence
from locus.engine.model.kv_cache import PagedKVCache
from locus.engine.model.model import Llama4ForCausalLM
from locus.kernels import argmax_cpu
from locus.routing.gate import TopK

_NO_IDS = torch.empty(0, dtype=torch.long)


@dataclass
class Feed:
    """The previous step's sampled ids, still on the device, for the sequences whose newest token is one
    of them."""

    tokens: torch.Tensor  # [m] int64 on the model's device
    rows: dict[int, int]  # seq_id -> its row of tokens

    def source(self, seq: Sequence) -> int:
        row = self.rows.get(seq.seq_id)
        if row is None:
            raise RuntimeError(f"sequence {seq.seq_id} has a token in flight that the previous step did not sample")
        return row


def sources(seqs: list[Sequence], feed: Feed | None) -> list[int] | None:
    """Per sequence: its row in the feed (its newest token is in flight) or -1; None if none is in flight."""
    if not any(seq.in_flight for seq in seqs):
        return None
    if feed is None:
        raise RuntimeError("a sequence has a token in flight but the step has no feed of the previous tokens")
    return [feed.source(seq) if seq.in_flight else -1 for seq in seqs]


@dataclass
class PromptLogits:
    seq: Sequence
    first: int  # the first prompt position scored; row i predicts prompt token first + i + 1
    logits: torch.Tensor  # [positions, vocab]


@dataclass
class RunResult:
    sampled: list[Sequence]  # sequences that get a new token, in batch order
    logits: torch.Tensor | None  # [len(sampled), vocab] float32, or the model's dtype (decode graphs; CPU)
    routing: dict[int, TopK] | None  # layer -> top-k of every token of the batch (when recording)
    batch: ForwardBatch
    prompt_logits: list[PromptLogits]  # for requests that asked for prompt logprobs
    argmax: torch.Tensor | None = None  # [len(sampled)] argmax of each logits row, when already computed
    hidden: torch.Tensor | None = None  # [len(sampled), H] the sampled rows' hidden states, while logits wait


class ModelRunner:
    def __init__(self, model: Llama4ForCausalLM, cache: PagedKVCache, graphs: DecodeGraphs | None = None):
        self.model, self.cache = model, cache
        self.graphs = graphs  # decode graphs (decode_graph.py: captured and/or compiled); None = always eager

    def can_run_compiled(self, items: list[ScheduledSeq]) -> bool:
        """A pure decode micro-batch (each sequence's one new token is its last) that fits a bucket: it runs
        through the decode graphs. Such a step scores no prompt positions: every prompt token is
        already computed. A request that samples nothing never runs here (its one-token last prefill chunk looks like a decode)."""
        return (self.graphs is not None and len(items) <= self.graphs.max_batch
                and all(item.num_tokens == 1 and item.seq.num_uncomputed == 1
                        and item.seq.request.params.generates for item in items))

    @torch.inference_mode()
    def run(self, items: list[ScheduledSeq], record_routing: bool = False, defer_logits: bool = False,
            feed: Feed | None = None) -> RunResult:
        """One forward. defer_logits: leave the sampled rows' hidden states in the result for
        `attach_logits`, which runs the lm_head once for several micro-batches (its weight is read
        once, not once per micro-batch). feed: the previous step's sampled ids, for the sequences
        whose newest token is in flight."""
        if self.can_run_compiled(items):
            return self._run_compiled(items, record_routing, feed)
        spans, tokens, sample_rows, sampled = [], [], [], []
        prompt_rows: list[tuple[Sequence, int, int, int]] = []  # (seq, first position, first row, count)
        row = 0
        for item in items:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            spans.append(SequenceSpan(seq.seq_id, start, n))
            # a token in flight is a decode row's only token: a placeholder, filled in on the device
            tokens.append([0] if seq.in_flight else seq.token_slice(start, start + n))
            scored = seq.request.prompt_positions_scored
            if scored is not None:
                lo, hi = max(start, scored), min(start + n, len(seq.prompt_ids) - 1)
                if lo < hi:
                    prompt_rows.append((seq, lo, row + lo - start, hi - lo))
            row += n
            if n == seq.num_uncomputed and seq.request.params.generates:  # (a scoring request samples nothing)
                sample_rows.append(row - 1)
                sampled.append(seq)
        batch = ForwardBatch.from_spans(tokens, spans, device=self.model.device)
        fed = sources([item.seq for item in items], feed)
        if fed is not None:  # decode rows (one token each): row i is items[i]
            rows = np.flatnonzero(np.asarray(fed) >= 0)
            device = batch.input_ids.device
            batch.input_ids.index_copy_(0, to_device(rows, device),
                                        feed.tokens.index_select(0, to_device(np.asarray(fed)[rows], device)))
        self.cache.bind(batch, {item.seq.seq_id: item.seq.block_table for item in items})
        out = self.model(batch, self.cache, record_routing=record_routing)
        logits = hidden = argmax = None
        if sample_rows:
            hidden = out.hidden.index_select(0, to_device(np.asarray(sample_rows, dtype=np.int64), out.hidden.device))
            if not defer_logits:
                (logits, argmax), hidden = self.lm_head(hidden), None
        prompt_logits = [PromptLogits(seq, first, self.model.compute_logits(out.hidden[r0:r0 + count]))
                         for seq, first, r0, count in prompt_rows]
        return RunResult(sampled, logits, out.routing, batch, prompt_logits, argmax, hidden)

    def lm_head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, H] hidden states of sampled rows -> ([N, V] logits, [N] int64 argmax), as the decode
        graphs compute them: on CPU `W @ h^T` (the form that streams the weight once) with the C
        argmax sweep over its [V, N] layout; elsewhere the lm_head and a reduction. The logits keep
        the model's dtype on CPU (the sampler converts what it reads)."""
        if hidden.device.type == "cpu" and argmax_cpu.load_library() is not None:
            logits_vn = self.model.lm_head.weight @ hidden.T
            return logits_vn.T, argmax_cpu.vocab_argmax(logits_vn)
        logits = self.model.compute_logits(hidden)
        return logits, logits.argmax(dim=-1)

    @torch.inference_mode()
    def attach_logits(self, results: list[RunResult]) -> None:
        """The logits of every deferred result, from one lm_head call over their rows together."""
        waiting = [r for r in results if r.hidden is not None]
        if not waiting:
            return
        logits, argmax = self.lm_head(torch.cat([r.hidden for r in waiting]))
        sizes = [r.hidden.shape[0] for r in waiting]
        for r, part, top in zip(waiting, torch.split(logits, sizes), torch.split(argmax, sizes)):
            r.logits, r.argmax, r.hidden = part, top, None

    def _run_compiled(self, items: list[ScheduledSeq], record_routing: bool, feed: Feed | None) -> RunResult:
        seqs = [item.seq for item in items]
        token_ids = [0 if seq.in_flight else seq.last_token for seq in seqs]  # (in flight: filled in on the device)
        positions = [seq.num_computed for seq in seqs]
        fed = sources(seqs, feed)
        out = self.graphs.run(token_ids, positions, [seq.block_table for seq in seqs], fed,
                              feed.tokens if fed is not None else None)
        routing = None
        if record_routing:
            routing = {layer: TopK(out.expert_ids[:, i], out.expert_weights[:, i])
                       for i, layer in enumerate(self.graphs.moe_layers)}
        # The batch is what the routing subscribers read (row ranges); it is not run.
        spans = [SequenceSpan(seq.seq_id, p, 1) for seq, p in zip(seqs, positions)]
        batch = ForwardBatch(_NO_IDS, _NO_IDS, spans)
        return RunResult(seqs, out.logits, routing, batch, [], out.argmax)
