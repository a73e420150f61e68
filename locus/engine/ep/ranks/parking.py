"""Adds waiting for their output grammar to compile (worker.py): the compile runs in a thread, so the
add waits and the lockstep does not. Rank 0 sends the add once; the rank adds it at the first
iteration after the compile is done, or refuses it with the compiler's error."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from locus.engine.ep.ranks.messages import Add


class ParkedAdds:
    def __init__(self, compile_grammar):
        self._compile = compile_grammar  # spec -> compiled grammar (raises for a bad one)
        self._adds: dict[str, tuple[Add, Future]] = {}
        self._pool: ThreadPoolExecutor | None = None  # started at the first add that needs it

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._adds

    def park(self, add: Add) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="locus-grammar")
        self._adds[add.request_id] = (add, self._pool.submit(self._compile, add.params.structured))

    def pop(self, request_id: str) -> Add | None:
        """Forget a parked add (aborted or dropped before it ran here); None when none was parked."""
        parked = self._adds.pop(request_id, None)
        return None if parked is None else parked[0]

    def ready(self) -> list[tuple[Add, BaseException | None]]:
        """The adds whose compile is done, each with its failure (None: compiled), taken out."""
        done = [(rid, add, future) for rid, (add, future) in self._adds.items() if future.done()]
        for rid, _, _ in done:
            del self._adds[rid]
        return [(add, future.exception()) for _, add, future in done]
