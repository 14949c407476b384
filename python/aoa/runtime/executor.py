"""Execute a plan, a group of destination shards at a time, into buffers the caller gives.

The executor owns the choice of backend and the bookkeeping between a plan's global shard
indices and the buffers at hand: the caller (a checkpoint writer, `aoa.load`) decides where
each destination shard's bytes live and when, so memory stays bounded by what it holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from aoa.plan import Plan, PlannedCopy

Buffer = object
#: the backends run a list of runtime Copy records: (copies, sources, destinations, threads)
BACKENDS = ("cpp", "numpy")


def _run(backend: str, copies, sources, destinations, threads: int | None) -> None:
    if backend == "numpy":
        from aoa.runtime.numpy_backend import execute_copies as run_numpy

        run_numpy(copies, sources, destinations)
    else:
        from aoa.runtime.cpp_backend import execute_copies as run_cpp

        run_cpp(copies, sources, destinations, threads)


class PlanExecutor:
    """Fills destination shards of ``plan`` from source buffers.

    ``source_buffer(i)`` returns the buffer of ``plan.sources[i]`` (C order, its dtype);
    it is asked once per source shard, when a copy first needs it. ``release(i)``, if
    given, is told after each fill which source shards it read (to drop their pages)."""

    def __init__(self, plan: Plan, source_buffer: Callable[[int], Buffer], *,
                 backend: str = "cpp", threads: int | None = None,
                 progress: Callable[[int], None] | None = None,
                 release: Callable[[int], None] | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (choose from {BACKENDS})")
        self.plan = plan
        self.backend = backend
        self.threads = threads
        self.progress = progress
        self._source_buffer = source_buffer
        self._release = release
        self._sources: dict[int, Buffer] = {}
        self._by_destination = plan.copies_by_destination()

    def fill(self, destinations: Sequence[int], buffers: Sequence[Buffer]) -> None:
        """Run every copy into ``plan.destinations[destinations[k]]``, held by ``buffers[k]``.

        Regions no copy writes are left as they are (a fresh file or array reads zeros)."""
        local = {index: k for k, index in enumerate(destinations)}
        planned: list[PlannedCopy] = [c for index in destinations
                                      for c in self._by_destination[index]]
        if not planned:
            return
        used = sorted({c.source for c in planned})
        source_slot = {index: k for k, index in enumerate(used)}
        sources = [self._source(index) for index in used]
        copies = [dataclasses.replace(c, source=source_slot[c.source],
                                      destination=local[c.destination])
                  for c in self.plan.kernel_copies(planned)]
        _run(self.backend, copies, sources, buffers, self.threads)
        if self._release is not None:
            for index in used:
                self._release(index)
        if self.progress is not None:
            self.progress(sum(self.plan.shard_bytes(i) for i in destinations))

    def _source(self, index: int) -> Buffer:
        buffer = self._sources.get(index)
        if buffer is None:
            buffer = self._sources[index] = self._source_buffer(index)
        return buffer
