"""Lowering a plan as planned, a block of copies at a time for all the keys that share it,
gives the kernel copies that lowering each copy on its own gives."""

from __future__ import annotations

from sharding import sharded

import aoa
from aoa.plan import CopyTable
from aoa.runtime.lower import kernel_copies


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
