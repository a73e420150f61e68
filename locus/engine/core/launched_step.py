"""A step launched and not yet finished: what EngineCore's two halves of a step hand each other, and how
its steps run one after the other or overlapped with the host's work (vLLM's async scheduling, SGLang's
overlap scheduler; EngineCore.step runs the schedule).

A step has two halves (EngineCore):
- `launch`: schedule, queue the forward and the sampler on the device, and queue ONE readback of the
  step's results (sampled ids, the logprobs asked for, routing) into pinned memory. Nothing in it
  waits for the device (host_transfer.py);
- `finish`: wait for that readback, then publish the routing, append each token, detokenize, check
  stops and build the step's outputs.

Serial: launch N, finish N. Overlapped: launch N + 1, then finish N, so the device runs step N + 1 while
the host finishes step N, and the next call schedules N + 2 as soon as N + 1 is queued. Step N + 1 is
scheduled before step N's tokens reach the host: each sequence's newest token is then in flight
(`Sequence.in_flight`), a placeholder on the host, and the device copies it from step N's sampled ids
into step N + 1's inputs (runner.Feed). What stays exact:
- greedy tokens are those of the serial order (the device computes the same thing, in the same order);
- a sequence that step N's token finishes (a stop token or string) had one more token launched in step
  N + 1: finishing N finishes the sequence (its blocks go back; later device work is queued after
  N + 1's), and finishing N + 1 drops that row. At most one step of work is discarded and no extra
  token is delivered;
- max_tokens is known ahead: a sequence whose token in flight is its last is not scheduled again;
- an abort or a failure between the halves finishes the sequence; its rows in flight are dropped;
- a sequence preempted while its token is in flight gets that token when step N finishes; its
  recompute waits for it (scheduler).
A step whose sequences' next sampling needs their newest token on the host (a grammar fills its mask
from it; penalties count it) is finished before the next one is scheduled: the serial order, for that
step. Under expert parallelism the pipeline is serial: ranks step in lockstep, each rank's step one
collective sequence that the others must meet (docs/engine.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from locus.engine.requests.sequence import Request, ScheduledSeq, Sequence
from locus.engine.host_transfer import Readback
from locus.engine.runner.model_runner import Feed, PromptLogits, RunResult
from locus.engine.sampling.sampler import SampleLaunch


@dataclass
class LaunchedSample:
    """One micro-batch's sampling, queued: what `finish` needs once its arrays are on the host."""

    seqs: list[Sequence]  # one per sampled row (n > 1 requests: the parent, then its new forks)
    launch: SampleLaunch
    handles: list[int]  # readback indices: the tokens, then the logprob arrays
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, child) created at launch

    def needs_host_tokens(self) -> bool:
        """Whether a sequence's next sampling needs this step's token on the host first."""
        return any(not s.is_finished and (s.sampling.grammar is not None or s.sampling.params.has_penalties)
                   for s in self.seqs)


@dataclass
class LaunchedBatch:
    """One micro-batch of a launched step."""

    items: list[ScheduledSeq]
    result: RunResult
    routing: int | None = None  # readback index of the packed routing
    prompts: list[tuple[PromptLogits, list[int]]] = field(default_factory=list)  # prompt logprobs' readback indices
    sample: LaunchedSample | None = None


@dataclass
class LaunchedStep:
    batches: list[LaunchedBatch]
    readback: Readback
    failed: list[Request] = field(default_factory=list)  # requests a launch failed (they report at finish)

    def feed(self) -> Feed | None:
        """This step's sampled ids, still on the device, for the next step's inputs."""
        samples = [b.sample for b in self.batches if b.sample is not None]
        if not samples:
            return None
        rows, offset = {}, 0
        for sample in samples:
            for i, seq in enumerate(sample.seqs):
                rows[seq.seq_id] = offset + i
            offset += len(sample.seqs)
        tokens = samples[0].launch.token_ids if len(samples) == 1 else torch.cat([s.launch.token_ids for s in samples])
        return Feed(tokens, rows)

    def needs_host_tokens(self) -> bool:
        return any(b.sample is not None and b.sample.needs_host_tokens() for b in self.batches)
