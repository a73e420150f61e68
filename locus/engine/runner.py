"""Model runner: turns one scheduled micro-batch into a forward pass over the paged KV cache.

It computes logits only for the sequences that sample this step (those whose every token is now
computed, unless the request only scores its prompt: max_tokens 0): the middle chunks of a long
prefill need no lm_head. The one exception: a request that
asked for prompt logprobs gets logits for the prompt positions this step computes that it has not
scored yet (each position predicts the next prompt token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from locus.engine.decode_graph import DecodeGraphs
from locus.engine.model.forward_batch import ForwardBatch, SequenceSpan
from locus.engine.grouping import ScheduledSeq
from locus.engine.model.kv_cache import PagedKVCache
from locus.engine.model.model import Llama4ForCausalLM
from locus.engine.sequence import Sequence
from locus.routing.gate import TopK


@dataclass
class PromptLogits:
    seq: Sequence
    first: int  # the first prompt position scored; row i predicts prompt token first + i + 1
    logits: torch.Tensor  # [positions, vocab]


@dataclass
class RunResult:
    sampled: list[Sequence]  # sequences that get a new token, in batch order
    logits: torch.Tensor | None  # [len(sampled), vocab] float32 (compiled decode steps: the model's dtype)
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
                and all(item.num_tokens == 1 and item.seq.num_computed + 1 == item.seq.num_tokens
                        and item.seq.request.params.generates for item in items))

    @torch.inference_mode()
    def run(self, items: list[ScheduledSeq], record_routing: bool = False, defer_logits: bool = False) -> RunResult:
        """One forward. defer_logits: leave the sampled rows' hidden states in the result for
        `attach_logits`, which runs the lm_head once for several micro-batches (its weight is read
        once, not once per micro-batch)."""
        if self.can_run_compiled(items):
            return self._run_compiled(items, record_routing)
        spans, tokens, sample_rows, sampled = [], [], [], []
        prompt_rows: list[tuple[Sequence, int, int, int]] = []  # (seq, first position, first row, count)
        row = 0
        for item in items:
            seq, n = item.seq, item.num_tokens
            start = seq.num_computed
            spans.append(SequenceSpan(seq.seq_id, start, n))
            tokens.append(seq.token_slice(start, start + n))
            scored = seq.request.prompt_positions_scored
            if scored is not None:
                lo, hi = max(start, scored), min(start + n, len(seq.prompt_ids) - 1)
                if lo < hi:
                    prompt_rows.append((seq, lo, row + lo - start, hi - lo))
            row += n
            if start + n == seq.num_tokens and seq.request.params.generates:  # (a scoring request samples nothing)
                sample_rows.append(row - 1)
                sampled.append(seq)
        batch = ForwardBatch.from_spans(tokens, spans, device=self.model.device)
        self.cache.bind(batch, {item.seq.seq_id: item.seq.block_table for item in items})
        out = self.model(batch, self.cache, record_routing=record_routing)
        logits = hidden = None
        if sample_rows:
            hidden = out.hidden[torch.tensor(sample_rows, device=out.hidden.device)]
            if not defer_logits:
                logits, hidden = self.model.compute_logits(hidden), None
        prompt_logits = [PromptLogits(seq, first, self.model.compute_logits(out.hidden[r0:r0 + count]))
                         for seq, first, r0, count in prompt_rows]
        return RunResult(sampled, logits, out.routing, batch, prompt_logits, hidden=hidden)

    @torch.inference_mode()
    def attach_logits(self, results: list[RunResult]) -> None:
        """The logits of every deferred result, from one lm_head call over their rows together."""
        waiting = [r for r in results if r.hidden is not None]
        if not waiting:
            return
        logits = self.model.compute_logits(torch.cat([r.hidden for r in waiting]))
        for r, part in zip(waiting, torch.split(logits, [r.hidden.shape[0] for r in waiting])):
            r.logits, r.hidden = part, None

    def _run_compiled(self, items: list[ScheduledSeq], record_routing: bool) -> RunResult:
        seqs = [item.seq for item in items]
        token_ids = [seq.last_token for seq in seqs]
        positions = [seq.num_computed for seq in seqs]
        out = self.graphs.run(token_ids, positions, [seq.block_table for seq in seqs])
        routing = None
        if record_routing:
            routing = {layer: TopK(out.expert_ids[:, i], out.expert_weights[:, i])
                       for i, layer in enumerate(self.graphs.moe_layers)}
        # The batch is what the routing subscribers read (row ranges); it is not run.
        spans = [SequenceSpan(seq.seq_id, p, 1) for seq, p in zip(seqs, positions)]
        batch = ForwardBatch(torch.tensor(token_ids), torch.tensor(positions), spans)
        return RunResult(seqs, out.logits, routing, batch, [], out.argmax)
