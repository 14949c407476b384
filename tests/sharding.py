"""Shard layouts for tests: a tensor split into equal shards along one axis."""

from __future__ import annotations

import aoa


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
