"""Shard layouts for tests: a tensor split into equal shards along one axis, buffers for
shards, and a global tensor put together from a source's shards."""

from __future__ import annotations

import numpy as np

import aoa
from aoa.dtypes import numpy_dtype
from aoa.storage import Source


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


def assemble(source: Source, key: str) -> np.ndarray:
    """The global tensor ``key``, put together from the source's shards' buffers."""
    shards = source.shards[key]
    whole = np.zeros(shards[0].global_shape, numpy_dtype(shards[0].dtype))
    for shard in shards:
        local = np.frombuffer(source.buffer(shard), whole.dtype).reshape(shard.local_shape)
        whole[tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape))] \
            = local
    return whole


class ListBoxes:
    """A shard descriptor of another class than `aoa.ShardDesc`, with lists for boxes, from
    a shard's JSON form: the Paddle drop-in does not take it for one of its planned shards,
    so it works its answer out and checks it when asked."""

    def __init__(self, query: dict) -> None:
        self.key, self.dtype = query["key"], query["dtype"]
        self.local_shape, self.global_shape, self.global_offset = (
            list(query[name]) for name in ("local_shape", "global_shape", "global_offset"))
