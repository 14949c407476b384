"""The kernel's copy table (the layout of cpp/copy_kernel.hpp): runtime `Copy` records packed
into int64 fields back to back, and read back; and a whole plan lowered into one such table,
once, from which the executor takes each fill's records with numpy.

Per copy, the C++ kernel and the numpy reference run the same table: the kernel reads it as
it is, the reference reads it back into `Copy` records (`unpack`).

A plan of many small tensors has hundreds of thousands of copies and as many destination
shards; lowering and packing them one by one for each fill was most of the time of writing
them (`bench/small_tensors.py`). `PlanTable` lowers each block of copies that keys laid out
alike share (`aoa.passes.share_instances`) once, makes the records of every key sharing it
with numpy, and groups all records by destination shard: a fill then gathers the records of
its pieces' shards and renumbers their buffers, with no Python work per copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import aoa._core as _core
from aoa.errors import ExecutionError
from aoa.plan import CopyTable, KeyedCopy, Plan, PlannedCopy
from aoa.runtime.copies import BlockScale, Copy, check_fields
from aoa.runtime.lower import lower

#: Paddle dtype name -> the kernel's code (enum aoa::Dtype in cpp/casts.hpp), as the
#: kernel itself says.
DTYPE_CODES: dict[str, int] = dict(_core.DTYPE_CODES)
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}

#: Where a record's buffer numbers lie, from its first field.
SOURCE, DESTINATION = 0, 2


def record(copy: Copy) -> tuple[list[int], int]:
    """``copy``'s fields, and where among them its scale source lies (-1: none)."""
    fields = [copy.source, copy.source_offset, copy.destination, copy.destination_offset,
              DTYPE_CODES[copy.source_dtype], DTYPE_CODES[copy.destination_dtype],
              len(copy.via), *(DTYPE_CODES[dtype] for dtype in copy.via),
              len(copy.shape), *copy.shape, *copy.source_strides, *copy.destination_strides]
    scale = copy.scale
    if scale is None:
        fields.append(0)
        return fields, -1
    at = len(fields) + 1
    fields += (1, scale.source, DTYPE_CODES[scale.dtype], scale.offset, *scale.blocks,
               *scale.phases, *scale.strides)
    return fields, at


def pack(copies: Sequence[Copy]) -> np.ndarray:
    """The kernel's table of ``copies``: one record per copy."""
    return pack_records(copies)[0]


def pack_records(copies: Sequence[Copy]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The table of ``copies``, where each record starts (one more: the end) and where each
    one's scale source lies in the table (-1: none)."""
    fields: list[int] = []
    starts = [0]
    scales = []
    for index, copy in enumerate(copies):
        check_fields(index, copy)
        numbers, at = record(copy)
        scales.append(-1 if at < 0 else len(fields) + at)
        fields += numbers
        starts.append(len(fields))
    try:
        table = np.array(fields, dtype=np.int64)
    except OverflowError:
        index = next(i for i, copy in enumerate(copies) if not _fits_int64(copy))
        raise ExecutionError(f"copy {index}: a number does not fit in 64 bits") from None
    return table, np.array(starts, np.int64), np.array(scales, np.int64)


def _fits_int64(copy: Copy) -> bool:
    numbers = (copy.source, copy.source_offset, copy.destination, copy.destination_offset,
               *copy.shape, *copy.source_strides, *copy.destination_strides)
    if copy.scale is not None:
        scale = copy.scale
        numbers += (scale.source, scale.offset, *scale.blocks, *scale.phases, *scale.strides)
    return all(-(2**63) <= n < 2**63 for n in numbers)


def unpack(table: np.ndarray) -> list[Copy]:
    """The copies of a table `pack` made (the reference backend runs them)."""
    fields = table.tolist()
    copies = []
    at = 0
    while at < len(fields):
        source, source_offset, destination, destination_offset, source_dtype, \
            destination_dtype, via_count = fields[at:at + 7]
        at += 7
        via = tuple(_DTYPE_NAMES[code] for code in fields[at:at + via_count])
        at += via_count
        ndim = fields[at]
        shape = tuple(fields[at + 1:at + 1 + ndim])
        source_strides = tuple(fields[at + 1 + ndim:at + 1 + 2 * ndim])
        destination_strides = tuple(fields[at + 1 + 2 * ndim:at + 1 + 3 * ndim])
        at += 1 + 3 * ndim
        scale = None
        if fields[at]:
            scale_source, scale_dtype, scale_offset = fields[at + 1:at + 4]
            at += 4
            blocks, phases, strides = (tuple(fields[at + k * ndim:at + (k + 1) * ndim])
                                       for k in range(3))
            at += 3 * ndim
            scale = BlockScale(scale_source, scale_offset, strides, blocks, phases,
                               _DTYPE_NAMES[scale_dtype])
        else:
            at += 1
        copies.append(Copy(source, source_offset, source_strides, destination,
                           destination_offset, destination_strides, shape,
                           _DTYPE_NAMES[source_dtype], _DTYPE_NAMES[destination_dtype], via,
                           scale))
    return copies


def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The integers [starts[i], starts[i] + counts[i]) for each i, one after another."""
    kept = counts > 0
    starts, counts = starts[kept], counts[kept]
    if not len(counts):
        return np.zeros(0, np.int64)
    ends = np.cumsum(counts)
    steps = np.ones(int(ends[-1]), np.int64)  # each next integer is one more...
    steps[0] = starts[0]
    steps[ends[:-1]] = starts[1:] - (starts[:-1] + counts[:-1] - 1)  # ...but where one begins
    return np.cumsum(steps)


@dataclass(frozen=True)
class Records:
    """Kernel records back to back, with where each starts (one more: the end) and where
    its scale source lies in ``table`` (-1: none); buffer numbers as the maker chose."""

    table: np.ndarray
    starts: np.ndarray
    scales: np.ndarray

    def take(self, rows: np.ndarray) -> Records:
        """Records ``rows``, in that order."""
        lengths = self.starts[rows + 1] - self.starts[rows]
        table = self.table[ranges(self.starts[rows], lengths)]
        starts = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=starts[1:])
        scales = self.scales[rows]
        scaled = scales >= 0
        scales[scaled] += starts[:-1][scaled] - self.starts[rows][scaled]
        return Records(table, starts, scales)

    @staticmethod
    def join(parts: Sequence[Records]) -> Records:
        """One after another."""
        if len(parts) == 1:
            return parts[0]
        sizes = np.array([0, *(len(p.table) for p in parts)], np.int64).cumsum()
        starts = [parts[0].starts[:1]] + [p.starts[1:] + base for p, base in zip(parts, sizes)]
        scales = [np.where(p.scales >= 0, p.scales + base, -1) for p, base in zip(parts, sizes)]
        return Records(np.concatenate([p.table for p in parts]), np.concatenate(starts),
                       np.concatenate(scales))


class PlanTable:
    """Every copy of ``plan`` as a kernel record (``lowered``, in the order they were
    lowered): buffer numbers are plan indices (sources, and scales, by source shard;
    destinations by destination shard), offsets from each shard's first byte. By
    destination shard (in plan order within each), the ``i``-th record is
    ``lowered`` row ``order[i]``, made from ``plan.copies[plan_copies[i]]``; destination
    shard ``d``'s are ``firsts[d]`` to ``firsts[d + 1]``. A fill takes its rows straight
    from ``lowered`` (`rows`): the whole table is never copied into destination order."""

    def __init__(self, plan: Plan) -> None:
        if isinstance(plan.copies, CopyTable) and not plan.scales:
            lowered, destinations, plan_copies = _lower_blocks(plan, plan.copies)
        else:
            lowered, destinations, plan_copies = _lower_each(plan)
        self.lowered = lowered
        self.order = np.lexsort((plan_copies, destinations))
        self.plan_copies = plan_copies[self.order]
        self.firsts = np.zeros(len(plan.destinations) + 1, np.int64)
        np.cumsum(np.bincount(destinations, minlength=len(plan.destinations)),
                  out=self.firsts[1:])

    def rows(self, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of ``lowered`` holding the records of destination ``shards`` (in that
        order) and, for each, the position in ``shards`` of its own."""
        counts = self.firsts[shards + 1] - self.firsts[shards]
        return (self.order[ranges(self.firsts[shards], counts)],
                np.repeat(np.arange(len(shards)), counts))

    def sources_read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The source shards (and scales) records ``rows`` (of ``lowered``) read, once per
        record, and for each the position in ``rows`` of the record that reads it."""
        records = self.lowered
        scales = records.scales[rows]
        scaled = np.flatnonzero(scales >= 0)
        return (np.concatenate([records.table[records.starts[rows] + SOURCE],
                                records.table[scales[scaled]]]),
                np.concatenate([np.arange(len(rows)), scaled]))


def _lower_each(plan: Plan) -> tuple[Records, np.ndarray, np.ndarray]:
    """The records of ``plan``'s copies, lowered one by one (a plan read back from JSON, or
    one that dequantizes), their destinations and plan indices."""
    sources, destinations = plan.sources, plan.destinations
    lowered = []
    for c in plan.copies:
        scale = plan.scale_of(c)
        scales = None if scale is None else (sources[scale.scale], scale.scale, scale.block)
        lowered.append(lower(c, sources[c.source], destinations[c.destination], c.source,
                             c.destination, scales))
    records = Records(*pack_records(lowered))
    targets = np.array([c.destination for c in lowered], np.int64)
    return records, targets, np.arange(len(lowered), dtype=np.int64)


def _lower_blocks(plan: Plan, copies: CopyTable) -> tuple[Records, np.ndarray, np.ndarray]:
    """`_lower_each` by blocks: keys laid out alike share one block of copies, with shards of
    the same shapes and dtypes on both sides, so a block is lowered once and the records of
    every key sharing it made from those with numpy (they differ in shard numbers only),
    written straight into one table: no table per block, then joined (at 61x256, 24 MB of
    fresh pages faulted in and copied once more)."""
    keys: dict[int, tuple[Sequence[KeyedCopy], list[int], list[Sequence[int]], list[int]]] = {}
    base = 0
    for first, block, reads in copies.blocks():
        found = keys.get(id(block))
        if found is None:
            found = keys[id(block)] = (block, [], [], [])
        found[1].append(first)
        found[2].append(reads)
        found[3].append(base)
        base += len(block)
    groups = [(firsts, key_reads, bases, _first_key(plan, block, firsts[0], key_reads[0]))
              for block, firsts, key_reads, bases in keys.values() if block]
    table = np.empty(sum(len(firsts) * len(made[0]) for firsts, _, _, made in groups), np.int64)
    record_count = sum(len(firsts) * len(made[1]) for firsts, _, _, made in groups)
    starts = np.empty(record_count + 1, np.int64)
    targets, indices = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    table_at = record_at = 0
    for firsts, key_reads, bases, (fields, at, positions, reading) in groups:
        count, width, records = len(firsts), len(fields), len(at)
        sources = np.fromiter(itertools.chain.from_iterable(key_reads), np.int64,
                              count=count * len(key_reads[0])).reshape(count, -1)
        rows = table[table_at:table_at + count * width].reshape(count, width)
        rows[:] = fields
        rows[:, at + SOURCE] = sources[:, reading]
        target = np.array(firsts, np.int64)[:, None] + positions
        rows[:, at + DESTINATION] = target
        starts[record_at:record_at + count * records] = (
            table_at + np.arange(count, dtype=np.int64)[:, None] * width + at).ravel()
        targets.append(target.ravel())
        indices.append((np.array(bases, np.int64)[:, None]
                        + np.arange(records, dtype=np.int64)).ravel())
        table_at += count * width
        record_at += count * records
    starts[-1] = table_at
    return (Records(table, starts, np.full(record_count, -1, np.int64)),
            np.concatenate(targets), np.concatenate(indices))


def _first_key(plan: Plan, block: Sequence[KeyedCopy], first: int, reads: Sequence[int]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """The records of the first key sharing ``block`` (its first destination ``first``, the
    source of each read ``reads``), back to back: their fields, where each starts, each
    one's shard's position among the key's and its read's among the key's reads."""
    fields: list[int] = []
    starts: list[int] = []
    positions: list[int] = []
    reading: list[int] = []
    for k, read, d, shape, s, order, casts in block:
        source = int(reads[read])
        copy = lower(PlannedCopy(first + k, d, shape, source, s, order, casts),
                     plan.sources[source], plan.destinations[first + k], 0, 0)
        check_fields(len(starts), copy)
        starts.append(len(fields))
        positions.append(k)
        reading.append(read)
        fields += record(copy)[0]
    return (np.array(fields, np.int64), np.array(starts, np.int64),
            np.array(positions, np.int64), reading)
