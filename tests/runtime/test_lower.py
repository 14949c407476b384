"""Filling a destination a part at a time: element ranges as boxes, copies cut to them, and
the executor filling pieces that give the bytes a whole fill gives; and a plan as planned
lowered a block of copies at a time for all the keys that share it, as each copy alone."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sharding import sharded

import aoa
from aoa.plan import CopyTable
from aoa.runtime import reference
from aoa.runtime.executor import PlanExecutor
from aoa.runtime.lower import element_boxes, kernel_copies
from aoa.storage.formats import Piece


@st.composite
def ranges(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), max_size=4)))
    size = math.prod(shape)
    start = draw(st.integers(0, size))
    return shape, start, draw(st.integers(start, size))


@settings(max_examples=300, deadline=None)
@given(ranges())
def test_element_boxes_are_the_range_in_order(case) -> None:
    shape, start, stop = case
    numbers = np.arange(math.prod(shape)).reshape(shape)
    boxes = element_boxes(shape, start, stop)
    flat = [numbers[tuple(slice(a, a + n) for a, n in zip(low, extent))].ravel()
            for low, extent in boxes]
    got = np.concatenate(flat) if flat else np.array([], int)
    assert got.tolist() == list(range(start, stop))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


PROGRAM = """\
a^T -> x
b -> y, dtype='bfloat16'
a, b -> z, axis=1
c -> w
"""
SHAPES = {"a": (6, 5), "b": (6, 3), "c": (2, 3, 4)}


@pytest.mark.parametrize("cuts", [1, 2, 3, 7])
def test_pieces_fill_what_whole_shards_fill(cuts: int) -> None:
    """Every destination shard cut into ``cuts`` element ranges (edges anywhere), each
    range a piece of its own buffer: put together, the reference's bytes."""
    rng = np.random.default_rng(cuts)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    source = {k: sharded(k, s, 2, 0) for k, s in SHAPES.items()}
    produced = aoa.pipeline.analyze(PROGRAM, source, None).destination_shards()
    destination = {t.key: sharded(t.key, t.global_shape, 2, len(t.global_shape) - 1,
                                  t.dtype or "float32") for t in produced}
    plan = aoa.compile(PROGRAM, source, destination)
    want = reference.run_plan_on_arrays(plan, tensors)
    buffers = [np.ascontiguousarray(tensors[s.key][tuple(slice(o, o + n) for o, n in zip(
        s.global_offset, s.local_shape))]) for s in plan.sources]
    executor = PlanExecutor(plan, buffers.__getitem__, threads=2)
    for index, shard in enumerate(plan.destinations):
        size = math.prod(shard.local_shape)
        edges = sorted({0, size, *rng.integers(0, size, cuts - 1).tolist()})
        parts = [np.full(b - a, 0xAB, np.uint8).repeat(want[index].itemsize)
                 for a, b in itertools.pairwise(edges)]
        executor.fill([Piece(index, part, (a, b)) for part, a, b in
                       zip(parts, edges, edges[1:])])
        assert b"".join(p.tobytes() for p in parts) == want[index].tobytes(), shard.key


def test_a_shared_block_is_lowered_as_each_of_its_copies():
    # three layers laid out alike (one shared block) and a differently sharded extra key,
    # with a transpose, casts and shards of several sizes
    source = {f"w.{i}": sharded(f"w.{i}", (4, 6), 2, 0) for i in range(3)}
    source["b"] = sharded("b", (6, 8), 4, 1, "float16")
    destination = {f"v.{i}": sharded(f"v.{i}", (6, 4), 2, 1, "bfloat16") for i in range(3)}
    destination["c"] = sharded("c", (6, 8), 2, 0, "float32")
    plan = aoa.compile(["w.$LAYER_ID^T -> v.$LAYER_ID, dtype='bfloat16'",
                        "b -> c, dtype='float32'"], source, destination)
    assert isinstance(plan.copies, CopyTable)
    blocks = [id(block) for _, block, _ in plan.copies.blocks()]
    assert len(blocks) == 4 and len(set(blocks)) == 2  # the layers share one block
    by_block = kernel_copies(plan)
    assert by_block == kernel_copies(plan, list(plan.copies))  # one copy at a time
    assert [(c.source, c.destination) for c in by_block] == [
        (c.source, c.destination) for c in plan.copies]
