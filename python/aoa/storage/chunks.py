"""The stored chunks of one key, as a sharded format finds them, turned into its shards.

Checked the same way for every format that splits a tensor over files: one dtype and rank,
replicas (every rank of a data- or tensor-parallel group saving a replicated tensor) kept
once, and the distinct chunks tiling the global shape exactly (no element twice, none
missing), with the box arithmetic of `aoa.layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from aoa.dtypes import itemsize
from aoa.errors import StorageError, quote
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


def key_shards(key: str, chunks: Sequence[Chunk],
               global_shape: tuple[int, ...] | None = None) -> list[tuple[ShardDesc, object]]:
    """The distinct shards of ``key`` with their locations, sorted by global offset.

    ``global_shape``: as the format records it; None: where the furthest chunk ends."""
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
