"""Execute a plan, a group of destination pieces at a time, into buffers the caller gives.

The executor owns the choice of backend and the bookkeeping between a plan's global shard
indices and the buffers at hand: the caller (a destination format's writer, `aoa.load`, the
CUDA staging) decides where each destination shard's bytes live and when, so memory stays
bounded by what it holds. A piece is a whole destination shard or a range of its elements.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from aoa.dtypes import itemsize
from aoa.errors import ExecutionError, StorageError
from aoa.plan import Plan
from aoa.runtime.copies import Copy
from aoa.runtime.kernel_table import DESTINATION, SOURCE, PlanTable, Records, pack_records
from aoa.runtime.lower import cut_elements, lower
from aoa.runtime.releases import SourceReleases
from aoa.storage.formats import Piece
from aoa.storage.read_ahead import ReadAhead
from aoa.storage.writer import StagedPieces

Buffer = object
#: plan indices of source shards -> buffers, and each shard's (buffer, offset, bytes) in them
SourceWindows = Callable[[np.ndarray], tuple[Sequence[Buffer], np.ndarray]]
#: the files a source reads, and plan indices of source shards -> (file, offset, bytes) rows
SourceExtents = tuple[Sequence[Path], Callable[[np.ndarray], np.ndarray]]
#: the backends: the C++ kernel, and the numpy reference it is checked against
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


def _run(backend: str, table: np.ndarray, sources: Sequence[Buffer],
         destinations: Sequence[Buffer], windows: np.ndarray | None, threads: int | None,
         source_windows: np.ndarray | None = None) -> None:
    """Run the kernel table ``table`` (`aoa.runtime.kernel_table`); ``windows``, when given:
    the destinations the table numbers are these (buffer, offset, bytes) ranges of
    ``destinations``; ``source_windows`` the same for the sources."""
    if backend == "numpy":
        from aoa.runtime.kernel_table import unpack
        from aoa.runtime.numpy_backend import byte_array
        from aoa.runtime.numpy_backend import execute_copies as run_numpy

        if windows is not None:
            whole = [byte_array(b, f"destination {i}", writable=True)
                     for i, b in enumerate(destinations)]
            destinations = [whole[b][o:o + n] for b, o, n in windows.tolist()]
        if source_windows is not None:
            read = [byte_array(b, f"source {i}", writable=False)
                    for i, b in enumerate(sources)]
            sources = [read[b][o:o + n] for b, o, n in source_windows.tolist()]
        run_numpy(unpack(table), sources, destinations)
    else:
        from aoa.runtime.cpp_backend import execute_table

        execute_table(table, sources, destinations, threads, windows, source_windows)


class PlanExecutor:
    """Fills destination shards of ``plan`` from source buffers.

    ``source_buffer(i)`` returns the buffer of ``plan.sources[i]`` (C order, its dtype);
    it is asked once per source shard, when a copy first needs it; ``source_buffers``, if
    given, is asked instead, for all of a fill's new shards at once; ``source_windows``, if
    given, instead of both, for all of a fill's shards (plan indices, an int64 array): a
    few buffers and a (buffer, offset, bytes) row per shard, the shards' bytes as ranges of
    those buffers (no view per shard: a plan of small tensors reads tens of thousands).
    ``release(indices)``, if given, is told after a fill, all at once, which source shards
    to drop the pages of (`aoa.runtime.releases`: those read for the last time, or all
    those kept once they pass a bound). ``source_extents``, if given, says which file holds
    each source shard and where: the shards that `expect`-ed fills will read are then read
    into the page cache ahead of them (`aoa.storage.read_ahead`); `close` stops that.
    ``clear_untouched``: zero the pieces of shards no copy writes (``_ -> X``), for
    buffers that are not fresh (a file's staging buffers); else they are left as they are
    (the caller's arrays). ``source_file(i)`` names the file behind source shard ``i``: a
    source cut short while it is read is then a StorageError naming it.

    The whole plan is lowered into one kernel table when the executor is made
    (`aoa.runtime.kernel_table.PlanTable`); a fill takes the records of its pieces' shards
    from it with numpy, and lowers only the copies of pieces that hold part of a shard."""

    def __init__(self, plan: Plan, source_buffer: Callable[[int], Buffer], *,
                 backend: str = "cpp", threads: int | None = None,
                 progress: Callable[[int], None] | None = None,
                 release: Callable[[list[int]], None] | None = None,
                 clear_untouched: bool = False,
                 source_file: Callable[[int], object] | None = None,
                 source_buffers: Callable[[list[int]], list[Buffer]] | None = None,
                 source_windows: SourceWindows | None = None,
                 source_extents: SourceExtents | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} (choose from {BACKENDS})")
        self.plan = plan
        self.backend = backend
        self.threads = threads
        self.progress = progress
        self._source_buffer = source_buffer
        self._source_buffers = source_buffers
        self._source_windows = source_windows
        self._source_file = source_file
        self._sources: dict[int, Buffer] = {}
        self._table = PlanTable(plan)
        self._releases = None if release is None else SourceReleases(self._table, plan, release)
        self._untouched = (np.array(sorted(set(plan.untouched)), np.int64) if clear_untouched
                           else np.zeros(0, np.int64))
        self._source_extents = source_extents
        self._read_ahead: ReadAhead | None = None
        #: the expected fills: each destination shard's place among them (-1: none), and
        #: the read-ahead's mark once the sources of the shards up to each place are read
        self._places: np.ndarray | None = None
        self._marks = np.zeros(0, np.int64)
        self._read_ahead_of = np.zeros(len(plan.sources), bool)  # source shards asked for

    def expect(self, shards: np.ndarray) -> None:
        """The destination shards (plan indices) that the next fills fill, in that order (a
        file's, as a writer starts it): their source shards are read into the page cache
        ahead of the fills, each once, where ``source_extents`` says where they lie and the
        file is not in memory already (`aoa.storage.read_ahead`)."""
        if self._source_extents is None or not len(shards):
            return
        paths, extents = self._source_extents
        if self._read_ahead is None:
            self._read_ahead = ReadAhead(paths)
        if not self._read_ahead.wanted:  # a source in memory: no work here either
            return
        rows, places = self._table.rows(shards)
        sources, readers = self._table.sources_read(rows)
        places = places[readers]
        fresh = ~self._read_ahead_of[sources]
        sources, places = sources[fresh], places[fresh]
        distinct, first = np.unique(sources, return_index=True)
        order = np.argsort(places[first], kind="stable")  # as the fills will first read them
        distinct, first = distinct[order], first[order]
        self._read_ahead_of[distinct] = True
        where = extents(distinct)
        marks = self._read_ahead.expect(where[:, 0], where[:, 1], where[:, 2])
        by_place = np.zeros(len(shards), np.int64)
        np.maximum.at(by_place, places[first], marks)
        if self._places is None:
            self._places = np.full(len(self.plan.destinations), -1, np.int64)
        self._places[self._places >= 0] = -1
        self._places[shards] = np.arange(len(shards))
        self._marks = np.maximum.accumulate(by_place)

    def close(self) -> None:
        """Stop reading sources ahead (`expect`)."""
        if self._read_ahead is not None:
            self._read_ahead.close()
            self._read_ahead = None

    def fill(self, pieces: Sequence[Piece]) -> None:
        """Run every copy into the pieces (all of a destination shard, or its elements
        ``piece.elements``): a `Fill` for a destination format's writer. Pieces staged in
        one buffer (`aoa.storage.writer.StagedPieces`) go to the kernel as that buffer."""
        plan = self.plan
        windows: np.ndarray | None
        if isinstance(pieces, StagedPieces):
            shards, firsts, lasts = pieces.shards, pieces.firsts, pieces.lasts
            destinations: list[Buffer] = [pieces.buffer]
            windows = np.stack([np.zeros_like(pieces.offsets), pieces.offsets, pieces.nbytes],
                               axis=1)
            filled = int(pieces.nbytes.sum())
        else:
            shards = np.array([piece.shard for piece in pieces], np.int64)
            firsts = np.array([-1 if p.elements is None else p.elements[0] for p in pieces],
                              np.int64)
            lasts = np.array([-1 if p.elements is None else p.elements[1] for p in pieces],
                             np.int64)
            destinations = [piece.buffer for piece in pieces]
            windows = None
            filled = sum(plan.destinations[piece.shard].nbytes if piece.elements is None else
                         (piece.elements[1] - piece.elements[0])
                         * itemsize(plan.destinations[piece.shard].dtype or "float32")
                         for piece in pieces)
        if self._read_ahead is not None and self._places is not None and len(shards):
            place = int(self._places[shards].max())
            if place >= 0:  # the sources up to this fill's last shard are wanted now
                self._read_ahead.reached(int(self._marks[place]))
        if len(self._untouched):
            for slot in np.flatnonzero(np.isin(shards, self._untouched)).tolist():
                _zero(pieces[slot].buffer)
        records, whole = self._records(shards, firsts, lasts)
        if len(records.starts) > 1:
            read, read_nbytes, reads = self._run(records, destinations, windows, whole)
            if self._releases is not None:
                self._releases.filled(shards, firsts, lasts, read, read_nbytes, reads)
        if self.progress is not None:
            self.progress(filled)

    def _records(self, shards: np.ndarray, firsts: np.ndarray, lasts: np.ndarray
                 ) -> tuple[Records, int]:
        """The records filling the pieces (destination ``shards``, element ranges
        [firsts, lasts) or whole where -1), piece ``i`` as destination ``i``; sources by
        plan index. The first of them, as many as the second value says, are the table's
        rows of the whole pieces' shards; the parts' lowered records follow."""
        table = self._table
        whole = np.flatnonzero(firsts < 0)
        rows, of_piece = table.rows(shards[whole])
        parts = [table.lowered.take(rows)]
        parts[0].table[parts[0].starts[:-1] + DESTINATION] = whole[of_piece]
        cut = np.flatnonzero(firsts >= 0).tolist()
        if cut:
            parts.append(Records(*pack_records(
                [copy for slot in cut for copy in
                 self._lower_part(slot, int(shards[slot]), int(firsts[slot]),
                                  int(lasts[slot]))])))
        return Records.join(parts), len(rows)

    def _lower_part(self, slot: int, index: int, start: int, stop: int) -> list[Copy]:
        """The copies writing elements [start, stop) of destination shard ``index`` into
        destination ``slot``, which holds them."""
        plan, table = self.plan, self._table
        shard = plan.destinations[index]
        planned = [plan.copies[i] for i in
                   table.plan_copies[table.firsts[index]:table.firsts[index + 1]].tolist()]
        base = start * itemsize(shard.dtype or "float32")
        lowered = []
        for c in cut_elements(planned, shard.local_shape, start, stop):
            scale = plan.scale_of(c)
            scales = None if scale is None else (plan.sources[scale.scale], scale.scale,
                                                 scale.block)
            lowered.append(lower(c, plan.sources[c.source], shard, c.source, slot, scales,
                                 base))
        return lowered

    def _run(self, records: Records, destinations: Sequence[Buffer],
             windows: np.ndarray | None, whole: int
             ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Run ``records`` (sources by plan index), the sources renumbered to the buffers
        the fill reads; the source shards read (distinct), their bytes where the source
        windows say them, and how often the first ``whole`` records read each (sources
        and scales)."""
        plan, table = self.plan, records.table
        scaled = np.flatnonzero(records.scales >= 0)
        where = np.concatenate([records.starts[:-1] + SOURCE, records.scales[scaled]])
        used, slots = np.unique(table[where], return_inverse=True)
        count = len(records.starts) - 1
        reads = np.bincount(np.concatenate([slots[:whole], slots[count:][scaled < whole]]),
                            minlength=len(used))
        table[where] = slots
        source_windows = None
        if self._source_windows is not None:
            sources, source_windows = self._source_windows(used)
        else:
            sources = self._buffers(used.tolist())
        try:
            _run(self.backend, table, sources, destinations, windows, self.threads,
                 source_windows)
        except VanishedBuffer as vanished:
            if vanished.role != "source" or self._source_file is None:
                raise
            index = int(used[vanished.index])
            shard = plan.sources[index]
            raise StorageError(
                f"{self._source_file(index)}: cut short while aoa read "
                f"it: byte {vanished.offset} of tensor '{shard.key}' is no longer in the file",
                hint="Something truncated or rewrote the file during the conversion; "
                     "run it again once the file is whole.") from None
        return used, None if source_windows is None else source_windows[:, 2], reads

    def _buffers(self, used: list[int]) -> list[Buffer]:
        """The buffers of source shards ``used`` (plan indices), each asked for once."""
        cached = self._sources
        new = [index for index in used if index not in cached]
        if self._source_buffers is not None and new:
            cached.update(zip(new, self._source_buffers(new)))
        else:
            for index in new:
                cached[index] = self._source_buffer(index)
        return [cached[index] for index in used]


def _zero(buffer: Buffer) -> None:
    np.frombuffer(buffer, np.uint8).fill(0)  # type: ignore[call-overload]
