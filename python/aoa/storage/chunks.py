"""The stored chunks of one key, as a sharded format finds them, turned into its shards.

Checked the same way for every format that splits a tensor over files: one dtype and rank,
replicas (every rank of a data- or tensor-parallel group saving a replicated tensor) kept
once, and the distinct chunks tiling the global shape exactly (no element twice, none
missing), with the box arithmetic of `aoa.layout`.

A checkpoint of tens of thousands of keys is checked in bulk (`shards_by_key`): what
concerns each chunk alone (types, ranks, dtypes, key names) over all chunks at once, then
key by key a short test that the chunks are the whole tensor or pieces of it cut along one
axis, edge to edge, as nearly every checkpoint stores them. Any key that fails it gets the
full checks, which name what is wrong.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from aoa.dtypes import ITEMSIZES, itemsize
from aoa.errors import StorageError, quote
from aoa.inputs import is_text
from aoa.layout import ShardDesc, distinct_boxes, tiling_fault
from aoa.limits import shape_problem


class Chunk(NamedTuple):
    """One stored chunk of a key: its box, dtype, the file holding it (for messages) and
    where the format finds its bytes."""

    local_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    dtype: str
    file: Path
    location: object


def shards_by_key(found: Mapping[str, Sequence[Chunk]],
                  global_shapes: Mapping[str, tuple[int, ...]] | None = None
                  ) -> dict[str, list[tuple[ShardDesc, object]]]:
    """`key_shards` of every key of ``found`` (in its order: the first key at fault raises),
    checked in bulk. ``global_shapes``: each key's, as the format records it; None: where
    its furthest chunk ends."""
    typed = _well_typed(found)
    cuts: dict[object, tuple[list[int], tuple[int, ...]] | None] = {}
    result = {}
    for key, chunks in found.items():
        global_shape = None if global_shapes is None else global_shapes[key]
        cut = None
        if typed and (global_shape is None or (type(global_shape) is tuple
                      and _INT_ONLY.issuperset(map(type, global_shape)))):
            # keys stored alike (the experts of a layer) share the test's answer
            boxes = (tuple(map(_BOX_AND_DTYPE, chunks)), global_shape)
            cut = cuts[boxes] if boxes in cuts else cuts.setdefault(
                boxes, _cut_along_one_axis(chunks, global_shape))
        if cut is None:
            result[key] = _checked_closely(key, chunks, global_shape)
            continue
        positions, shape = cut
        dtype = chunks[0].dtype
        result[key] = [(_unchecked(key, chunk.local_shape, shape, chunk.global_offset, dtype),
                        chunk.location) for chunk in map(chunks.__getitem__, positions)]
    return result


def key_shards(key: str, chunks: Sequence[Chunk],
               global_shape: tuple[int, ...] | None = None) -> list[tuple[ShardDesc, object]]:
    """The distinct shards of ``key`` with their locations, sorted by global offset.

    ``global_shape``: as the format records it; None: where the furthest chunk ends."""
    return shards_by_key({key: chunks}, None if global_shape is None else {key: global_shape}
                         )[key]


def _checked_closely(key: str, chunks: Sequence[Chunk], global_shape: tuple[int, ...] | None
                     ) -> list[tuple[ShardDesc, object]]:
    """`key_shards`, every check made chunk by chunk and box by box, naming the fault."""
    first = chunks[0]
    for chunk in chunks:
        if len(chunk.global_offset) != len(chunk.local_shape):
            raise StorageError(f"tensor '{key}': chunk in {chunk.file} has global offset "
                               f"{quote(list(chunk.global_offset))} and shape "
                               f"{list(chunk.local_shape)} of different ranks")
        if chunk.dtype != first.dtype or len(chunk.local_shape) != len(first.local_shape):
            raise StorageError(
                f"tensor '{key}' is {chunk.dtype} {list(chunk.local_shape)} in {chunk.file} but "
                f"{first.dtype} {list(first.local_shape)} in {first.file}"
            )
    ends = [tuple(start + size for start, size in zip(c.global_offset, c.local_shape,
                                                     strict=True)) for c in chunks]
    if global_shape is None:
        global_shape = tuple(map(max, zip(*ends, strict=True)))
    problem = shape_problem(global_shape, itemsize(first.dtype))
    if problem is not None:
        raise StorageError(f"tensor '{key}': its global shape {quote(list(global_shape))} "
                           f"{problem}; files: " + _files(chunks))
    for chunk, end in zip(chunks, ends):
        if len(end) != len(global_shape) or any(e > n for e, n in zip(end, global_shape)):
            raise StorageError(
                f"tensor '{key}': chunk at {quote(list(chunk.global_offset))} of shape "
                f"{list(chunk.local_shape)} in {chunk.file} reaches past its global shape "
                f"{list(global_shape)}")
    ordered = sorted(chunks, key=lambda chunk: chunk.global_offset)
    distinct = [ordered[i] for i in distinct_boxes(ordered)]
    check_tiling(key, global_shape, distinct)
    return [(ShardDesc(key, c.local_shape, global_shape, c.global_offset, c.dtype), c.location)
            for c in distinct]


def _well_typed(found: Mapping[str, Sequence[Chunk]]) -> bool:
    """Whether each key is text and each chunk's boxes are tuples of ints of one rank, its
    dtype a known name: what `ShardDesc` checks of each shard, over all chunks at once."""
    keys = list(found)
    chunks = list(itertools.chain.from_iterable(found.values()))
    dtypes = list(map(_DTYPE, chunks))
    offsets = list(map(_GLOBAL_OFFSET, chunks))
    sizes = list(map(_LOCAL_SHAPE, chunks))
    return (_STR_ONLY.issuperset(map(type, keys))
            and (all(map(str.isascii, keys)) or all(map(is_text, keys)))
            and _STR_ONLY.issuperset(map(type, dtypes)) and ITEMSIZES.keys() >= set(dtypes)
            and _TUPLE_ONLY.issuperset(map(type, offsets))
            and _TUPLE_ONLY.issuperset(map(type, sizes))
            and list(map(len, offsets)) == list(map(len, sizes))
            and _INT_ONLY.issuperset(map(type, itertools.chain.from_iterable(offsets)))
            and _INT_ONLY.issuperset(map(type, itertools.chain.from_iterable(sizes))))


def _cut_along_one_axis(chunks: Sequence[Chunk], global_shape: tuple[int, ...] | None
                        ) -> tuple[list[int], tuple[int, ...]] | None:
    """Where ``chunks`` (well typed: `_well_typed`) are the whole tensor, or pieces of it
    cut along one axis, edge to edge, all of one dtype: the positions of the distinct ones
    sorted by global offset, and the global shape. None for any others. Such chunks pass
    every check of `key_shards` and of `ShardDesc`, so their shards are made unchecked."""
    first = chunks[0]
    dtype, rank = first.dtype, len(first.local_shape)
    positions = [0]
    if len(chunks) > 1:
        if not ({dtype}.issuperset(map(_DTYPE, chunks))
                and {rank}.issuperset(map(len, map(_LOCAL_SHAPE, chunks)))):
            return None
        ordered = sorted(range(len(chunks)), key=lambda i: chunks[i].global_offset)
        positions = [ordered[i] for i in distinct_boxes([chunks[i] for i in ordered])]
        first = chunks[positions[0]]
    last = chunks[positions[-1]]
    shape = (tuple(map(operator.add, last.global_offset, last.local_shape))
             if global_shape is None else global_shape)
    if (type(shape) is not tuple or len(shape) != rank
            or not _INT_ONLY.issuperset(map(type, shape)) or min(shape, default=1) <= 0
            or shape_problem(shape, itemsize(dtype)) is not None):
        return None  # nothing to hold, or too much: the full checks say what
    # the axis the pieces are cut along: where the first one is not whole (any, if it is)
    axis = next((axis for axis in range(rank) if first.local_shape[axis] != shape[axis]), 0)
    rest = shape[:axis] + shape[axis + 1:]
    zeros = (0,) * (rank - 1)
    end = 0
    for position in positions:
        offset, size = chunks[position].global_offset, chunks[position].local_shape
        if rank and (offset[axis] != end or size[axis] <= 0
                     or size[:axis] + size[axis + 1:] != rest
                     or offset[:axis] + offset[axis + 1:] != zeros):
            return None
        end += size[axis] if rank else 1
    if end != (shape[axis] if rank else 1):
        return None
    return positions, shape


_INT_ONLY = frozenset({int})
_STR_ONLY = frozenset({str})
_TUPLE_ONLY = frozenset({tuple})
_GLOBAL_OFFSET = operator.attrgetter("global_offset")
_LOCAL_SHAPE = operator.attrgetter("local_shape")
_DTYPE = operator.attrgetter("dtype")
_BOX_AND_DTYPE = operator.attrgetter("global_offset", "local_shape", "dtype")
_unchecked = ShardDesc.unchecked


def check_tiling(key: str, shape: tuple[int, ...], chunks: Sequence[Chunk]) -> None:
    """No two chunks share an element, and together they cover the global shape."""
    fault = tiling_fault(shape, chunks)
    if fault is None:
        return
    if fault.overlap is not None:
        first, second = (chunks[n] for n in fault.overlap)
        raise StorageError(
            f"tensor '{key}': chunk at {list(first.global_offset)} in {first.file} "
            f"overlaps chunk at {list(second.global_offset)} in {second.file}"
        )
    raise StorageError(
        f"tensor '{key}': its chunks cover {fault.covered} of the {fault.total} elements of "
        f"its global shape {list(shape)}; files: " + _files(chunks)
    )


def _files(chunks: Sequence[Chunk]) -> str:
    return ", ".join(sorted({str(chunk.file) for chunk in chunks}))
