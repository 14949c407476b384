"""Execute a plan, a group of destination pieces at a time, into buffers the caller gives.

The executor owns the choice of backend and the bookkeeping between a plan's global shard
indices and the buffers at hand: the caller (a destination format's writer, `aoa.load`, the
CUDA staging) decides where each destination shard's bytes live and when, so memory stays
bounded by what it holds. A piece is a whole destination shard or a range of its elements.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from aoa.dtypes import itemsize
from aoa.errors import ExecutionError, StorageError
from aoa.plan import Plan, PlannedCopy
from aoa.runtime.copies import Copy
from aoa.runtime.lower import cut_elements, lower
from aoa.storage.formats import Piece

Buffer = object
#: the backends run a list of runtime Copy records: (copies, sources, destinations, threads)
BACKENDS = ("cpp", "numpy")


class VanishedBuffer(ExecutionError):
    """The memory behind buffer ``index`` of ``role`` ("source", "destination"; None: in
    neither) vanished at byte ``offset`` while the copies ran: a mapped file was cut short
    under them. The copies stopped there."""

    def __init__(self, message: str, role: str | None, index: int, offset: int) -> None:
        super().__init__(message)
        self.role = role
        self.index = index
        self.offset = offset


def _run(backend: str, copies: Sequence[Copy], sources: Sequence[Buffer],
         destinations: Sequence[Buffer], threads: int | None) -> None:
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
    given, is told after each fill which source shards it read (to drop their pages).
    ``clear_untouched``: zero the pieces of shards no copy writes (``_ -> X``), for
    buffers that are not fresh (a file's staging buffers); else they are left as they are
    (the caller's arrays). ``source_file(i)`` names the file behind source shard ``i``: a
    source cut short while it is read is then a StorageError naming it."""

    def __init__(self, plan: Plan, source_buffer: Callable[[int], Buffer], *,
                 backend: str = "cpp", threads: int | None = None,
                 progress: Callable[[int], None] | None = None,
                 release: Callable[[int], None] | None = None,
                 clear_untouched: bool = False,
                 source_file: Callable[[int], object] | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (choose from {BACKENDS})")
        self.plan = plan
        self.backend = backend
        self.threads = threads
        self.progress = progress
        self._source_buffer = source_buffer
        self._release = release
        self._source_file = source_file
        self._sources: dict[int, Buffer] = {}
        self._by_destination = plan.copies_by_destination()
        self._untouched = frozenset(plan.untouched) if clear_untouched else frozenset()

    def fill(self, pieces: Sequence[Piece]) -> None:
        """Run every copy into the pieces (all of a destination shard, or its elements
        ``piece.elements``): a `Fill` for a destination format's writer."""
        plan = self.plan
        planned: list[tuple[int, PlannedCopy, int]] = []
        filled = 0
        for slot, piece in enumerate(pieces):
            shard = plan.destinations[piece.shard]
            copies: Sequence[PlannedCopy] = self._by_destination[piece.shard]
            base = 0
            if piece.elements is not None:
                start, stop = piece.elements
                copies = list(cut_elements(copies, shard.local_shape, start, stop))
                size = itemsize(shard.dtype or "float32")
                base = start * size
                filled += (stop - start) * size
            else:
                filled += shard.nbytes
            if piece.shard in self._untouched:
                np.frombuffer(piece.buffer, np.uint8).fill(0)  # type: ignore[call-overload]
            planned += [(slot, c, base) for c in copies]
        if planned:
            scale_of = {c: scale for _, c, _ in planned
                        if (scale := plan.scale_of(c)) is not None}
            used = sorted({c.source for _, c, _ in planned}
                          | {scale.scale for scale in scale_of.values()})
            source_slot = {index: k for k, index in enumerate(used)}
            sources = [self._source(index) for index in used]
            copies_run = []
            for slot, c, base in planned:
                scale = scale_of.get(c)
                scales = None if scale is None else (plan.sources[scale.scale],
                                                     source_slot[scale.scale], scale.block)
                copies_run.append(lower(c, plan.sources[c.source], plan.destinations[c.destination],
                                        source_slot[c.source], slot, scales, base))
            try:
                _run(self.backend, copies_run, sources, [piece.buffer for piece in pieces],
                     self.threads)
            except VanishedBuffer as vanished:
                if vanished.role != "source" or self._source_file is None:
                    raise
                shard = plan.sources[used[vanished.index]]
                raise StorageError(
                    f"{self._source_file(used[vanished.index])}: cut short while aoa read it: "
                    f"byte {vanished.offset} of tensor '{shard.key}' is no longer in the file",
                    hint="Something truncated or rewrote the file during the conversion; "
                         "run it again once the file is whole.") from None
            if self._release is not None:
                for index in used:
                    self._release(index)
        if self.progress is not None:
            self.progress(filled)

    def _source(self, index: int) -> Buffer:
        buffer = self._sources.get(index)
        if buffer is None:
            buffer = self._sources[index] = self._source_buffer(index)
        return buffer
