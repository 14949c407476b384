"""The stored chunks of one key, as a sharded format finds them, turned into its shards.

Checked the same way for every format that splits a tensor over files: one dtype and rank,
replicas (every rank of a data- or tensor-parallel group saving a replicated tensor) kept
once, and the distinct chunks tiling the global shape exactly (no element twice, none
missing).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from aoa.errors import StorageError
from aoa.layout import ShardDesc

#: Above this many boundary-grid cells (irregular chunks), compare chunks pairwise instead.
MAX_GRID_CELLS = 1 << 22


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
        if chunk.dtype != first.dtype or len(chunk.local_shape) != len(first.local_shape):
            raise StorageError(
                f"tensor '{key}' is {chunk.dtype} {list(chunk.local_shape)} in {chunk.file} but "
                f"{first.dtype} {list(first.local_shape)} in {first.file}"
            )
    if global_shape is None:
        ends = [tuple(start + size for start, size in zip(c.global_offset, c.local_shape,
                                                         strict=True)) for c in chunks]
        global_shape = tuple(map(max, zip(*ends, strict=True)))
    ordered = sorted(chunks, key=lambda chunk: chunk.global_offset)
    first_of: dict[tuple, Chunk] = {}
    for chunk in ordered:
        first_of.setdefault((chunk.global_offset, chunk.local_shape), chunk)
    distinct = list(first_of.values())
    check_tiling(key, global_shape, distinct)
    return [(ShardDesc(key, c.local_shape, global_shape, c.global_offset, c.dtype), c.location)
            for c in distinct]


def check_tiling(key: str, shape: tuple[int, ...], chunks: Sequence[Chunk]) -> None:
    """No two chunks share an element, and together they cover the global shape."""
    solid = [chunk for chunk in chunks if math.prod(chunk.local_shape)]  # others hold nothing
    boxes = (len(solid), len(shape))
    starts = np.array([chunk.global_offset for chunk in solid], np.int64).reshape(boxes)
    ends = starts + np.array([chunk.local_shape for chunk in solid], np.int64).reshape(boxes)
    pair = _overlapping_pair(starts, ends)
    if pair is not None:
        first, second = (solid[n] for n in pair)
        raise StorageError(
            f"tensor '{key}': chunk at {list(first.global_offset)} in {first.file} "
            f"overlaps chunk at {list(second.global_offset)} in {second.file}"
        )
    covered = sum(math.prod(chunk.local_shape) for chunk in solid)
    if covered != math.prod(shape):
        raise StorageError(
            f"tensor '{key}': its chunks cover {covered} of the {math.prod(shape)} elements of "
            f"its global shape {list(shape)}; files: "
            + ", ".join(sorted({str(chunk.file) for chunk in chunks}))
        )


def _overlapping_pair(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    """Two boxes [start, end) that share an element, if any.

    Counted on the grid of all box boundaries: a cell between consecutive boundaries is
    wholly inside a box or wholly outside, so a cell inside two boxes is an overlap. The
    counts come from a difference array (+1/-1 at each box's corners, then a cumulative sum
    per axis), in time linear in boxes and cells; irregular boxes fall back to pairs.
    """
    count, ndim = starts.shape
    if count < 2:
        return None
    if ndim == 0:
        return (0, 1)
    bounds = [np.unique(np.concatenate([starts[:, a], ends[:, a]])) for a in range(ndim)]
    if math.prod(len(b) - 1 for b in bounds) > MAX_GRID_CELLS:
        return _overlapping_pair_pairwise(starts, ends)
    low = [np.searchsorted(bounds[a], starts[:, a]) for a in range(ndim)]
    high = [np.searchsorted(bounds[a], ends[:, a]) for a in range(ndim)]
    cells = np.zeros([len(b) for b in bounds], np.int32)
    for corner in itertools.product((False, True), repeat=ndim):
        index = tuple(high[a] if up else low[a] for a, up in enumerate(corner))
        np.add.at(cells, index, -1 if sum(corner) % 2 else 1)
    for axis in range(ndim):
        cells = np.cumsum(cells, axis=axis)
    crowded = np.argwhere(cells > 1)
    if not len(crowded):
        return None
    point = np.array([bounds[a][crowded[0][a]] for a in range(ndim)])
    inside = np.flatnonzero(((starts <= point) & (point < ends)).all(axis=1))
    return int(inside[0]), int(inside[1])


def _overlapping_pair_pairwise(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    """The same answer by comparing each box with every later one, a block at a time."""
    for first in range(0, len(starts), 256):
        block = slice(first, first + 256)
        inner = np.minimum(ends[block, None], ends[None]) > np.maximum(
            starts[block, None], starts[None]
        )
        shared = inner.all(axis=2) & (
            np.arange(len(starts))[None] > np.arange(first, first + len(inner))[:, None]
        )
        if shared.any():
            i, j = np.argwhere(shared)[0]
            return first + int(i), int(j)
    return None
