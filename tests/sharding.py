"""Shard layouts for tests: a tensor split into equal shards along one axis."""

from __future__ import annotations

import numpy as np

import aoa
from aoa.dtypes import numpy_dtype


def sharded(key, shape, count, axis, dtype="float32") -> list[aoa.ShardDesc]:
    """``count`` equal shards of ``key`` along ``axis`` (count 1: the whole tensor)."""
    shape = tuple(shape)
    step = shape[axis] // count if shape else 0
    shards = []
    for i in range(count):
        local, offset = list(shape), [0] * len(shape)
        if shape:
            local[axis], offset[axis] = step, i * step
        shards.append(aoa.ShardDesc(key, tuple(local), shape, tuple(offset), dtype))
    return shards


def shard_buffers(shards) -> dict[str, list[aoa.Shard]]:
    """A buffer (filled with 7s, to show what a load leaves untouched) per shard, by key."""
    into: dict[str, list[aoa.Shard]] = {}
    for s in shards:
        buffer = np.full(s.local_shape, 7, numpy_dtype(s.dtype))
        into.setdefault(s.key, []).append(aoa.Shard(buffer, s.global_shape, s.global_offset))
    return into
