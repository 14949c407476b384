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

A format that finds its chunks as columns (`ChunkColumns`: a safetensors folder's headers)
has them checked and turned into shards with no Python call per chunk (`stored_shards`):
keys are grouped and the test is made once per way of storing a key, then every shard is
made column by column.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from aoa.dtypes import ITEMSIZES, itemsize
from aoa.errors import StorageError, quote
from aoa.inputs import is_text
from aoa.layout import ReadShardInfo, ShardDesc, distinct_boxes, tiling_fault
from aoa.limits import shape_problem
from aoa.storage.formats import StoredShards


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
    typed = _well_typed_chunks(found)
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


class ChunkColumns(NamedTuple):
    """Stored chunks as columns of equal length, in the order a format finds them (a key's
    chunks need not be next to each other): each one's key, box, dtype, file and location."""

    keys: Sequence[str]
    local_shapes: Sequence[tuple[int, ...]]
    global_offsets: Sequence[tuple[int, ...]]
    dtypes: Sequence[str]
    files: Sequence[Path]
    locations: Sequence[object]


def stored_shards(columns: ChunkColumns, *, typed: bool = False) -> StoredShards:
    """`shards_by_key` of chunks given as columns, global shapes where the furthest chunk
    ends: keys in the order first found, each key's chunks in the order found. Keys stored
    alike (the same boxes and dtypes, in the same order) are tested once, every shard of the
    keys that pass is made column by column; the others get the full checks in turn.

    ``typed``: the format has checked what `_well_typed` checks (a safetensors header's
    reader has), so it is not checked again."""
    keys, shapes, offsets, dtypes, _, locations = columns
    first: dict[str, int] = {}  # key -> the row where it is first found
    firsts = list(map(first.setdefault, keys, itertools.count()))
    names = list(first)
    if not (typed or _well_typed(names, shapes, offsets, dtypes)):
        return as_stored(shards_by_key(_chunks_by_key(columns)))
    # each key's rows together, keys in the order first found: rows[start:end] are a key's
    rows: Sequence[int] = (range(len(keys)) if firsts == sorted(firsts) else
                           sorted(range(len(keys)), key=firsts.__getitem__))
    counts = list(collections.Counter(firsts).values())
    ends = list(itertools.accumulate(counts))
    starts = [0, *ends[:-1]]
    alike, cuts = _ways_and_cuts(shapes, offsets, dtypes, rows, counts, starts, ends)
    closely = {}  # the keys the test doubts, checked in full (in order: the first at fault raises)
    if None in cuts.values():
        closely = {position: _checked_closely(names[position], _chunks_of(
            columns, rows[starts[position]:ends[position]]), None)
            for position, first_alike in enumerate(alike) if cuts[first_alike] is None}
    made = list(map({first_alike: len(cut[0]) if cut else 0  # shards of each key
                     for first_alike, cut in cuts.items()}.__getitem__, alike))
    chosen = _chosen_rows(alike, cuts, counts, rows, starts, made)
    shard_keys = list(map(keys.__getitem__, chosen))
    shard_offsets = list(map(offsets.__getitem__, chosen))
    shape_of = {first_alike: cut[1] if cut else () for first_alike, cut in cuts.items()}
    shards = ShardDesc.many_unchecked(
        shard_keys, map(shapes.__getitem__, chosen),
        itertools.chain.from_iterable(map(itertools.repeat, map(shape_of.__getitem__, alike),
                                          made)),
        shard_offsets, map(dtypes.__getitem__, chosen))
    made_ends = list(itertools.accumulate(made))
    by_key = list(map(shards.__getitem__, map(slice, [0, *made_ends[:-1]], made_ends)))
    # (where each row is its own location, as a folder's rows are, the chosen rows are theirs:
    # no new int per shard to look up)
    rows_located = type(locations) is range and locations == range(len(keys))
    chosen_locations = (list(chosen) if rows_located else
                        list(map(locations.__getitem__, chosen)))
    if not closely:  # (the location dict made where asked: a conversion never asks)
        return StoredShards(ReadShardInfo.made(names, by_key, alike, shards), None,
                            (tuple(shards), chosen_locations))
    located = dict(zip(zip(shard_keys, shard_offsets), chosen_locations))
    for position, found in closely.items():
        by_key[position] = [shard for shard, _ in found]
        alike[position] = position  # made by the full checks: alike no other, for all we know
        located.update(((shard.key, shard.global_offset), location)
                       for shard, location in found)
    return _stored(ReadShardInfo.made(names, by_key, alike), located)


_Cut = tuple[list[int], tuple[int, ...]]


def _chosen_rows(alike: list[int], cuts: dict[int, _Cut | None], counts: list[int],
                 rows: Sequence[int], starts: list[int], made: list[int]) -> Sequence[int]:
    """The row of each shard made: each key's distinct chunks, sorted by global offset (as
    its way's cut says; none for a key whose way has no cut)."""
    if all(cut and cut[0] == list(range(counts[first_alike]))
           for first_alike, cut in cuts.items()):
        return rows  # no replicas, each key's chunks in order: every row
    positions = {first_alike: cut[0] if cut else [] for first_alike, cut in cuts.items()}
    return list(map(rows.__getitem__, map(
        operator.add, itertools.chain.from_iterable(map(positions.__getitem__, alike)),
        itertools.chain.from_iterable(map(itertools.repeat, starts, made)))))


def _ways_and_cuts(shapes: Sequence[tuple[int, ...]], offsets: Sequence[tuple[int, ...]],
                   dtypes: Sequence[str], rows: Sequence[int], counts: list[int],
                   starts: list[int], ends: list[int]
                   ) -> tuple[list[int], dict[int, _Cut | None]]:
    """How each key is stored, as the position of the first key stored alike (the same
    boxes and dtypes, in order), and `_cut_along_one_axis` of each such first key's chunks.
    (A way, a tuple per key, is hashed once here: the callers look up ints.)"""
    numbers: dict[tuple, int] = {}  # box and dtype -> the first row holding them
    boxes = list(map(numbers.setdefault, zip(offsets, shapes, dtypes), itertools.count()))
    if not isinstance(rows, range):
        boxes = list(map(boxes.__getitem__, rows))
    if len(set(counts)) == 1:  # as many rows each (one per file): a column per file
        ways = list(zip(*(boxes[n::counts[0]] for n in range(counts[0]))))
    else:  # (slices of a tuple are tuples: no list made per key)
        ways = list(map(tuple(boxes).__getitem__, map(slice, starts, ends)))
    first_of_way: dict[tuple[int, ...], int] = {}
    alike = list(map(first_of_way.setdefault, ways, itertools.count()))
    box_of = {number: _BoxChunk(*box) for box, number in numbers.items()}
    return alike, {first_alike: _cut_along_one_axis(list(map(box_of.__getitem__, way)), None)
                   for way, first_alike in first_of_way.items()}


class _BoxChunk(NamedTuple):
    """A chunk's box and dtype: what `_cut_along_one_axis` looks at."""

    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str


def _chunks_of(columns: ChunkColumns, rows: Sequence[int]) -> list[Chunk]:
    """The ``rows`` of ``columns`` as chunks."""
    return [Chunk(columns.local_shapes[row], columns.global_offsets[row], columns.dtypes[row],
                  columns.files[row], columns.locations[row]) for row in rows]


def _chunks_by_key(columns: ChunkColumns) -> dict[str, list[Chunk]]:
    """Chunks given as columns (each key's together) as each key's list of chunks."""
    found: dict[str, list[Chunk]] = {}
    for key, *row in zip(columns.keys, columns.local_shapes, columns.global_offsets,
                         columns.dtypes, columns.files, columns.locations):
        found.setdefault(key, []).append(Chunk(*row))
    return found


def as_stored(found: Mapping[str, Sequence[tuple[ShardDesc, object]]]) -> StoredShards:
    """Each key's (shard, location) pairs as `StoredShards`."""
    return _stored({key: [shard for shard, _ in pairs] for key, pairs in found.items()},
                   {(shard.key, shard.global_offset): location
                    for pairs in found.values() for shard, location in pairs})


def _stored(shards: dict[str, list[ShardDesc]],
            located: dict[tuple[str, tuple[int, ...]], object]) -> StoredShards:
    """`StoredShards` of each key's shards and their locations, every shard in one list
    with its location as looked up (`StoredShards.made`; shards of no elements may share a
    global offset, and so their location)."""
    made = tuple(itertools.chain.from_iterable(shards.values()))
    return StoredShards(shards, located, (made, list(map(located.__getitem__, zip(
        map(_KEY, made), map(_GLOBAL_OFFSET, made))))))


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
    if math.prod(global_shape):  # a box of no element holds no byte to read, and may lie at
        # the offset of one that does, while a shard is found by its key and offset
        distinct = [chunk for chunk in distinct if math.prod(chunk.local_shape)]
    return [(ShardDesc(key, c.local_shape, global_shape, c.global_offset, c.dtype), c.location)
            for c in distinct]


def _well_typed_chunks(found: Mapping[str, Sequence[Chunk]]) -> bool:
    """`_well_typed` of each key's chunks."""
    chunks = list(itertools.chain.from_iterable(found.values()))
    return _well_typed(found, list(map(_LOCAL_SHAPE, chunks)), list(map(_GLOBAL_OFFSET, chunks)),
                       list(map(_DTYPE, chunks)))


def _well_typed(keys: Iterable[Any], sizes: Sequence[Any], offsets: Sequence[Any],
                dtypes: Sequence[Any]) -> bool:
    """Whether each key is text and each chunk's boxes are tuples of ints of one rank, its
    dtype a known name: what `ShardDesc` checks of each shard, over all chunks at once."""
    keys = list(keys)
    return (_STR_ONLY.issuperset(map(type, keys))
            and (all(map(str.isascii, keys)) or all(map(is_text, keys)))
            and _STR_ONLY.issuperset(map(type, dtypes)) and ITEMSIZES.keys() >= set(dtypes)
            and _TUPLE_ONLY.issuperset(map(type, offsets))
            and _TUPLE_ONLY.issuperset(map(type, sizes))
            and list(map(len, offsets)) == list(map(len, sizes))
            and _INT_ONLY.issuperset(map(type, itertools.chain.from_iterable(offsets)))
            and _INT_ONLY.issuperset(map(type, itertools.chain.from_iterable(sizes))))


def _cut_along_one_axis(chunks: Sequence[Chunk] | Sequence[_BoxChunk],
                        global_shape: tuple[int, ...] | None
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
_KEY = operator.attrgetter("key")
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
