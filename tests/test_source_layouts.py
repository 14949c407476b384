"""The planner's view of source shards: replicas read once, gaps refused, and keys laid out
alike planned alike (the per-layout memo must not mix keys up)."""

from __future__ import annotations

import numpy as np
import pytest
from sharding import sharded

import aoa
from aoa.runtime import reference


def test_replicated_source_shards_are_read_once_from_the_first_listed():
    halves = sharded("w", (4, 6), 2, 0)
    replica = aoa.ShardDesc("w", (2, 6), (4, 6), (0, 0), "float32")
    source = {"w": [halves[0], halves[1], replica]}
    plan = aoa.compile("w -> v", source, {"v": sharded("v", (4, 6), 3, 1)})
    assert sorted((s.global_offset, s is halves[0]) for s in plan.sources) == [
        ((0, 0), True), ((2, 0), False)]
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    out = reference.run_plan_on_arrays(plan, {"w": w})
    assert [o.tobytes() for o in out] == [w[:, i:i + 2].copy().tobytes() for i in (0, 2, 4)]


@pytest.mark.parametrize("shards, why", [
    ([((0, 0), (2, 6)), ((3, 0), (1, 6))], "gap"),
    ([((0, 0), (3, 6)), ((2, 0), (2, 6))], "overlap"),
    ([((0, 0), (2, 6)), ((1, 0), (2, 6))], "overlap and gap"),  # as many elements as [4, 6]
])
def test_source_shards_that_do_not_tile_are_refused(shards, why):
    source = {"w": [aoa.ShardDesc("w", local, (4, 6), offset, "float32")
                    for offset, local in shards]}
    with pytest.raises(aoa.AoaError) as error:
        aoa.compile("w -> v", source, {"v": sharded("v", (4, 6), 1, 0)})
    assert str(error.value).splitlines()[0].endswith(
        "the shards of source key 'w' do not tile its global shape [4, 6] exactly once")


def test_keys_laid_out_alike_get_their_own_sources():
    """Many keys share one memoized recipe; each must still read its own key's shards, and a
    key laid out differently must get its own copies."""
    layers = 6
    source, destination, tensors = {}, {}, {}
    for layer in range(layers):
        count = 3 if layer == 4 else 2  # one layer sharded otherwise
        key = f"model.layers.{layer}.w"
        source[key] = sharded(key, (6, 4), count, 0)
        destination[f"layers.{layer}.w"] = sharded(f"layers.{layer}.w", (4, 6), 2, 1)
        tensors[key] = np.arange(24, dtype=np.float32).reshape(6, 4) + 100 * layer
    plan = aoa.compile("model.layers.$LAYER_ID.w^T -> layers.$LAYER_ID.w", source, destination)
    out = reference.run_plan_on_arrays(plan, tensors)
    for index, shard in enumerate(plan.destinations):
        layer = int(shard.key.split(".")[1])
        column = shard.global_offset[1]
        expected = tensors[f"model.layers.{layer}.w"].T[:, column:column + 3]
        assert out[index].tobytes() == np.ascontiguousarray(expected).tobytes()
