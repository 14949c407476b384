"""The executor drops a source shard's pages after the last fill that reads it, all the
shards of a fill in one call, or sooner, all of those kept, once they pass a bound."""

from __future__ import annotations

import numpy as np
import pytest
from sharding import sharded

import aoa
from aoa.dtypes import numpy_dtype
from aoa.runtime import releases
from aoa.runtime.executor import PlanExecutor
from aoa.storage import Piece


def split_plan():
    """Two source shards of w (rows), four destination shards of v (TP2 -> TP4 on the
    other axis, v = w^T): each source shard is read by every destination shard."""
    source = {"w": sharded("w", (4, 8), 2, 0)}
    destination = {"v": sharded("v", (8, 4), 4, 0)}
    plan = aoa.compile("w^T -> v", source, destination)
    buffers = [np.ones(s.local_shape, np.float32) for s in plan.sources]
    return plan, buffers


def fills(executor, plan, groups, cut=None):
    """Fill the destination shards in ``groups`` (a fill each); ``cut``: the shard filled
    in two halves, in two fills of their own, first."""
    if cut is not None:
        shard = plan.destinations[cut]
        half = int(np.prod(shard.local_shape)) // 2
        for first, last in ((0, half), (half, 2 * half)):
            executor.fill([Piece(cut, np.zeros(last - first, np.float32), (first, last))])
    for group in groups:
        executor.fill([Piece(i, np.zeros(plan.destinations[i].local_shape,
                                          numpy_dtype(plan.destinations[i].dtype)))
                       for i in group])


def test_each_source_shard_is_dropped_once_after_its_last_read():
    plan, buffers = split_plan()
    told = []
    executor = PlanExecutor(plan, buffers.__getitem__, release=told.append)
    fills(executor, plan, [[0], [1, 2], [3]])
    assert told == [[0, 1]]  # both read by every fill, the last read in the last


def test_a_shard_filled_in_parts_counts_once_all_its_parts_are_filled():
    plan, buffers = split_plan()
    told = []
    executor = PlanExecutor(plan, buffers.__getitem__, release=told.append)
    fills(executor, plan, [[0, 1, 2]], cut=3)
    assert told == [[0, 1]]
    told.clear()
    fills(executor, plan, [[0, 1, 3]], cut=2)  # read past their count: dropped after each
    assert told == [[0, 1], [0, 1], [0, 1]]


def test_shards_kept_past_the_bound_are_all_dropped(monkeypatch):
    plan, buffers = split_plan()
    monkeypatch.setattr(releases, "HELD_BYTES", plan.sources[0].nbytes)  # one shard's pages
    told = []
    executor = PlanExecutor(plan, buffers.__getitem__, release=told.append)
    fills(executor, plan, [[0], [1, 2], [3]])
    assert told == [[0, 1], [0, 1], [0, 1]]


@pytest.mark.parametrize("release", [True, False])
def test_the_bytes_do_not_depend_on_the_releases(release):
    plan, buffers = split_plan()
    executor = PlanExecutor(plan, buffers.__getitem__,
                            release=(lambda _: None) if release else None)
    out = [np.zeros(d.local_shape, np.float32) for d in plan.destinations]
    executor.fill([Piece(i, b) for i, b in enumerate(out)])
    assert all((b == 1).all() for b in out)


def test_a_fill_counts_its_whole_shards_reads_as_the_table_does():
    """A fill hands over how often its whole shards' records read each source; counted from
    the plan's table instead, the same shards are dropped after the same fills, with parts
    of a shard in the same fills as whole ones."""
    plan, buffers = split_plan()
    half = int(np.prod(plan.destinations[3].local_shape)) // 2

    def whole(i):
        return Piece(i, np.zeros(plan.destinations[i].local_shape, np.float32))

    def part(i, first, last):
        return Piece(i, np.zeros(last - first, np.float32), (first, last))

    told, recounted = [], []
    executor = PlanExecutor(plan, buffers.__getitem__, release=told.append)
    other = PlanExecutor(plan, buffers.__getitem__, release=recounted.append)
    assert other._releases is not None
    count = other._releases.filled
    other._releases.filled = lambda *given: count(*given[:5])  # (no counts: the table's)
    for each in (executor, other):
        each.fill([whole(0), part(3, 0, half)])
        each.fill([part(3, half, 2 * half), whole(1)])
        each.fill([whole(2)])
        each.fill([whole(0), whole(1)])  # read past their count: dropped at once
    assert told == recounted == [[0, 1], [0, 1]]
    assert executor._releases is not None
    assert np.array_equal(executor._releases._remaining, other._releases._remaining)
