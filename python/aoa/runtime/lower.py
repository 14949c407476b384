"""Lowering: a plan's copies (boxes in shard coordinates) become the kernel's copies (byte
offsets and strides over C-contiguous shard buffers).

The plan stays plain data; this is the first thing the runtime does with it. A destination
can also be filled a part at a time: a staging buffer holding rows [start, stop) of its
first axis (`cut_rows`), or any range of its elements in C order (`cut_elements`, for the
buffers of a file written front to back, whose edges fall anywhere): each keeps the parts
of the copies that write that part.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

from aoa.collector import collector_paused
from aoa.dtypes import itemsize
from aoa.layout import ShardDesc
from aoa.plan import CopyTable, KeyedCopy, Plan, PlannedCopy
from aoa.runtime.copies import BlockScale, Copy, c_strides

#: a dequantizing copy's scales as lowering needs them: (the scale shard, the buffer slot
#: holding it, elements per block along each axis of the tensor)
Scales = tuple[ShardDesc, int, tuple[int, ...]]


def lower(copy: PlannedCopy, source: ShardDesc, destination: ShardDesc,
          source_slot: int, destination_slot: int, scales: Scales | None = None,
          destination_base: int = 0) -> Copy:
    """``copy`` between the buffer ``source_slot`` (holding ``source``) and the buffer
    ``destination_slot`` (holding ``destination`` from its byte ``destination_base`` on),
    dequantized with ``scales`` if given."""
    source_dtype, destination_dtype = source.dtype or "float32", destination.dtype or "float32"
    source_strides = c_strides(source.local_shape, itemsize(source_dtype))
    destination_strides = c_strides(destination.local_shape, itemsize(destination_dtype))
    source_offset = sum(a * b for a, b in zip(copy.source_start, source_strides))
    destination_offset = sum(a * b for a, b in zip(copy.destination_start, destination_strides)
                             ) - destination_base
    if copy.order is not None:
        source_strides = tuple(source_strides[a] for a in copy.order)
    scale = None if scales is None else block_scale(copy, source, *scales)
    return Copy(source_slot, source_offset, source_strides, destination_slot,
                destination_offset, destination_strides, copy.shape, source_dtype,
                destination_dtype, copy.casts, scale)


def block_scale(copy: PlannedCopy, source: ShardDesc, shard: ShardDesc, slot: int,
                block: tuple[int, ...]) -> BlockScale:
    """Where the scales of ``copy``'s elements lie in the scale shard ``shard``: from the
    block of the copy's first element (its global position over the block, counted from
    the shard's first block), per destination axis the block, the phase and the stride."""
    first = [o + s for o, s in zip(source.global_offset, copy.source_start)]
    strides = c_strides(shard.local_shape, itemsize(shard.dtype or "float32"))
    offset = sum((g // b - o) * t
                 for g, b, o, t in zip(first, block, shard.global_offset, strides))
    order = copy.order if copy.order is not None else range(len(first))
    return BlockScale(slot, offset, tuple(strides[a] for a in order),
                      tuple(block[a] for a in order), tuple(first[a] % block[a] for a in order),
                      shard.dtype or "float32")


def kernel_copies(plan: Plan, copies: Iterable[PlannedCopy] | None = None) -> list[Copy]:
    """The plan's copies (or ``copies`` of it) for buffers numbered as the plan numbers its
    shards (scales too), in plan order."""
    if copies is None and isinstance(plan.copies, CopyTable) and not plan.scales:
        return _kernel_copies_by_block(plan, plan.copies)
    sources, destinations = plan.sources, plan.destinations
    lowered = []
    for c in plan.copies if copies is None else copies:
        scale = plan.scale_of(c)
        scales = None if scale is None else (sources[scale.scale], scale.scale, scale.block)
        lowered.append(lower(c, sources[c.source], destinations[c.destination], c.source,
                             c.destination, scales))
    return lowered


def _kernel_copies_by_block(plan: Plan, table: CopyTable) -> list[Copy]:
    """`kernel_copies` of a plan as planned: keys laid out alike share one block of copies,
    with shards of the same shapes and dtypes on both sides, so each block is lowered once
    and the copies of every other key sharing it differ only in their buffer slots."""
    sources, destinations = plan.sources, plan.destinations
    lowered: dict[int, list[tuple[int, int, dict]]] = {}  # id of a block -> its copies
    result: list[Copy] = []
    append = result.append
    # Hundreds of thousands of new objects and no reference cycles: the cyclic collector
    # would walk the growing heap again and again (half the time at 61x256), so it waits.
    with collector_paused():
        for first, block, reads in table.blocks():
            _lower_block(first, block, reads, sources, destinations, lowered, append)
    return result


def _lower_block(first: int, block: Sequence[KeyedCopy], reads: Sequence[int],
                 sources: Sequence[ShardDesc], destinations: Sequence[ShardDesc],
                 lowered: dict[int, list[tuple[int, int, dict]]],
                 append: Callable[[Copy], None]) -> None:
    """The kernel copies of one key's block (``lowered``: the blocks lowered already)."""
    parts = lowered.get(id(block))
    if parts is None:
        parts = lowered[id(block)] = [
            (k, read, vars(lower(PlannedCopy(first + k, d, shape, reads[read], s, order,
                                             casts),
                                 sources[reads[read]], destinations[first + k], 0, 0)))
            for k, read, d, shape, s, order, casts in block]
    for k, read, fields in parts:
        # the block's copy with this key's slots, made without Copy's frozen __init__
        copy = _new_copy(Copy)
        copy_fields = vars(copy)
        copy_fields.update(fields)
        copy_fields["source"] = reads[read]
        copy_fields["destination"] = first + k
        append(copy)


_new_copy = object.__new__


def rows_of(shard: ShardDesc, start: int, stop: int, dtype: str | None = None) -> ShardDesc:
    """Rows [start, stop) of ``shard``'s first axis as a shard of their own (in ``dtype``,
    default the shard's); a scalar is its own single row."""
    dtype = shard.dtype if dtype is None else dtype
    if not shard.local_shape:
        return dataclasses.replace(shard, dtype=dtype)
    offset = (shard.global_offset[0] + start, *shard.global_offset[1:])
    return ShardDesc(shard.key, (stop - start, *shard.local_shape[1:]), shard.global_shape,
                     offset, dtype)


def cut_rows(copies: Sequence[PlannedCopy], start: int, stop: int) -> Iterator[PlannedCopy]:
    """The parts of ``copies`` (of one destination) that write rows [start, stop) of it,
    with destination boxes relative to ``start``."""
    for c in copies:
        if not c.shape:
            yield c
            continue
        low = max(start, c.destination_start[0])
        high = min(stop, c.destination_start[0] + c.shape[0])
        if low >= high:
            continue
        axis = c.order[0] if c.order is not None else 0  # the source axis under axis 0
        source_start = list(c.source_start)
        source_start[axis] += low - c.destination_start[0]
        yield PlannedCopy(c.destination, (low - start, *c.destination_start[1:]),
                          (high - low, *c.shape[1:]), c.source, tuple(source_start), c.order,
                          c.casts)


def element_boxes(shape: tuple[int, ...], start: int, stop: int
                  ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, stop) (C order) of an array of ``shape`` as boxes (start, extent):
    at most two per axis, each a run of consecutive elements, in order."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, last = divmod(start, inner), divmod(stop, inner)
    if first[0] == last[0]:  # inside one row of the first axis
        return [((first[0], *lo), (1, *extent))
                for lo, extent in element_boxes(shape[1:], first[1], last[1])]
    boxes = []
    row = first[0]
    if first[1]:
        boxes += [((row, *lo), (1, *extent))
                  for lo, extent in element_boxes(shape[1:], first[1], inner)]
        row += 1
    if last[0] > row:
        boxes.append(((row, *(0,) * (len(shape) - 1)), (last[0] - row, *shape[1:])))
    if last[1]:
        boxes += [((last[0], *lo), (1, *extent))
                  for lo, extent in element_boxes(shape[1:], 0, last[1])]
    return boxes


def cut_elements(copies: Sequence[PlannedCopy], shape: tuple[int, ...], start: int,
                 stop: int) -> Iterator[PlannedCopy]:
    """The parts of ``copies`` (of one destination of ``shape``) that write its elements
    [start, stop), in the destination's own coordinates."""
    boxes = element_boxes(shape, start, stop)
    for c in copies:
        for low, extent in boxes:
            lo = tuple(map(max, low, c.destination_start))
            hi = tuple(min(a + n, b + m) for a, n, b, m in zip(low, extent, c.destination_start,
                                                               c.shape))
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            source_start = list(c.source_start)
            for axis, (a, b) in enumerate(zip(lo, c.destination_start)):
                source_start[c.order[axis] if c.order is not None else axis] += a - b
            yield PlannedCopy(c.destination, lo, tuple(b - a for a, b in zip(lo, hi)), c.source,
                              tuple(source_start), c.order, c.casts)
