"""What the server may know of a running engine, as named snapshots: `EngineInfo` (fixed once it is
built: the tokenizer, the context, the KV pool, the constraint compiler), `EngineHealth` (running or
dead, and under expert parallelism which ranks serve), `RecordingState` (the trace being recorded).
`AsyncEngine` serves them, with `EngineStats` (the counters), for either backend; the server reads
nothing else of the engine (tests/server/test_engine_interface.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from locus.engine.checkpoint.tokenizer import Tokenizer
from locus.engine.core.engine_core import EngineCore
from locus.engine.ep.ranks.health import EPHealth
from locus.engine.sampling.grammar import GrammarCompiler


@dataclass(frozen=True)
class EngineInfo:
    tokenizer: Tokenizer
    max_model_len: int  # the context limit, prompt and output
    vocab_size: int
    num_blocks: int  # KV-cache blocks in this process's pool
    block_size: int
    # The engine's constraint compiler: the server compiles a request's constraint into its cache (in its
    # pools, within a time budget) before admitting the request, so the engine thread finds it compiled.
    grammars: GrammarCompiler

    @classmethod
    def of(cls, core: EngineCore) -> "EngineInfo":
        return cls(core.tokenizer, core.max_model_len, core.model.config.vocab_size, core.blocks.num_blocks,
                   core.blocks.block_size, core.grammars)


@dataclass(frozen=True)
class EngineHealth:
    running: bool  # the engine thread serves (False: it stopped, or died of `error`)
    error: BaseException | None  # what it died of (None while it runs, or after a clean shutdown)
    ep: EPHealth | None = None  # the ranks, under expert parallelism


@dataclass(frozen=True)
class RecordingState:
    """The trace recording (--record-trace or /traces/start), or "idle" with none."""

    state: str  # idle, recording, stopped (takes no new requests), failed
    failures: int  # recordings an error stopped (a full disk, say) since the engine started
    name: str | None = None  # the trace's directory name (never its path: that stays the server's)
    requests: int = 0
    tokens: int = 0
    written_bytes: int = 0
    max_bytes: int | None = None
    stop_reason: str | None = None  # requested, budget, or the error's code (ENOSPC, say)
    failure: str | None = None  # the error that failed it


def recording_state(core: EngineCore) -> RecordingState:
    recorder = core.recorder
    if recorder is None:
        return RecordingState("idle", core.recording_failures)
    return RecordingState(recorder.state, core.recording_failures, recorder.path.name, recorder.requests,
                          recorder.tokens, recorder.written_bytes, recorder.max_bytes, recorder.stop_reason,
                          recorder.failure)
