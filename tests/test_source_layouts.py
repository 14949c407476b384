"""The planner's view of source shards: replicas read once, gaps refused, and keys laid out
alike planned alike (the per-layout memo must not mix keys up)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from sharding import sharded

import aoa
from aoa.cli import main
from aoa.compat.paddle import AOAEngine
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


NOT_TILED = [
    ([((0, 0), (2, 6)), ((3, 0), (1, 6))],
     "the source shards of 'w' cover 18 of the 24 elements of its global shape [4, 6]"),
    ([((0, 0), (3, 6)), ((2, 0), (2, 6))],
     "the source shards of 'w' overlap: [0:3, 0:6] and [2:4, 0:6] share elements of its "
     "global shape [4, 6]"),
    # overlapping and leaving a gap, with the volume of the whole: row 1 twice, row 3 never
    ([((0, 0), (2, 6)), ((1, 0), (2, 6))],
     "the source shards of 'w' overlap: [0:2, 0:6] and [1:3, 0:6] share elements of its "
     "global shape [4, 6]"),
    ([((0, 0), (2, 3)), ((2, 3), (2, 3)), ((1, 1), (2, 3)), ((0, 0), (2, 3))],
     "the source shards of 'w' overlap: [0:2, 0:3] and [1:3, 1:4] share elements of its "
     "global shape [4, 6]"),
]


def _not_tiled(shards) -> dict[str, list[aoa.ShardDesc]]:
    return {"w": [aoa.ShardDesc("w", local, (4, 6), offset, "float32")
                  for offset, local in shards]}


@pytest.mark.parametrize("shards, message", NOT_TILED)
def test_source_shards_that_do_not_tile_are_refused(shards, message):
    with pytest.raises(aoa.PlanError) as error:
        aoa.compile("w -> v", _not_tiled(shards), {"v": sharded("v", (4, 6), 1, 0)})
    assert str(error.value).splitlines()[0] == f"error: {message}"


@pytest.mark.parametrize("shards, message", NOT_TILED)
def test_the_paddle_engine_and_a_full_export_refuse_them_too(shards, message):
    """No destination (nothing planned) and the drop-in: the shards are checked as they
    come in, not when a plan reads them."""
    with pytest.raises(aoa.PlanError, match=re.escape(message)):
        aoa.compile("w -> v", _not_tiled(shards))
    with pytest.raises(aoa.PlanError, match=re.escape(message)):
        AOAEngine({"aoa_statements": ["w -> v"]}, _not_tiled(shards))


def test_shard_info_json_with_overlapping_shards_is_refused(tmp_path, capsys):
    source = tmp_path / "source.json"
    source.write_text(json.dumps({"w": [s.to_json() for s in _not_tiled(NOT_TILED[2][0])["w"]]}))
    mapping = tmp_path / "m.aoa"
    mapping.write_text("w -> v\n")
    assert main(["check", str(mapping), "--source", str(source)]) == 1
    assert capsys.readouterr().err.splitlines()[0] == f"error: {NOT_TILED[2][1]}"


@pytest.mark.parametrize("other, message", [
    (aoa.ShardDesc("w", (2, 6), (5, 6), (2, 0), "float32"),
     "the source shards of 'w' describe different tensors: [0:2, 0:6] of [4, 6] float32 and "
     "[2:4, 0:6] of [5, 6] float32"),
    (aoa.ShardDesc("w", (2, 6), (4, 6), (2, 0), "bfloat16"),
     "the source shards of 'w' describe different tensors: [0:2, 0:6] of [4, 6] float32 and "
     "[2:4, 0:6] of [4, 6] bfloat16"),
])
def test_shards_of_one_key_describe_one_tensor(other, message):
    source = {"w": [aoa.ShardDesc("w", (2, 6), (4, 6), (0, 0), "float32"), other]}
    with pytest.raises(aoa.PlanError) as error:
        aoa.compile("w -> v", source)
    assert str(error.value).splitlines()[0] == f"error: {message}"


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


@pytest.mark.parametrize("count", [2, 5, 16, 17, 40], ids=lambda n: f"{n}-boxes")
def test_overlapping_pair_agrees_with_counting_elements(count):
    """Few boxes are compared pairwise in Python, many on numpy's boundary grid: both find
    an overlap exactly when some element lies in two boxes, and name two boxes that share
    one."""
    from aoa.layout import overlapping_pair

    rng = np.random.default_rng(count)
    found = 0
    for _ in range(60):
        ndim = int(rng.integers(1, 4))
        shape = tuple(int(n) for n in rng.integers(2, 9, ndim))
        boxes = []
        for _ in range(count):
            start = tuple(int(rng.integers(0, n)) for n in shape)
            extent = tuple(int(rng.integers(1, n - a + 1)) for a, n in zip(start, shape))
            boxes.append(aoa.ShardDesc("w", extent, shape, start, "float32"))
        cells = np.zeros(shape, np.int32)
        for box in boxes:
            cells[tuple(slice(a, a + n) for a, n in zip(box.global_offset, box.local_shape))] += 1
        pair = overlapping_pair(boxes)
        assert (pair is not None) == bool((cells > 1).any())
        if pair is not None:
            found += 1
            one, other = (boxes[i] for i in pair)
            assert pair[0] != pair[1] and all(
                max(a, b) < min(a + n, b + m) for a, n, b, m in zip(
                    one.global_offset, one.local_shape, other.global_offset, other.local_shape))
    assert found  # the cases hold overlaps, not only tilings
