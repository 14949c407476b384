"""The planner's CopyTable reads like the list of PlannedCopy rows it stands for: length,
order, indexing, equality, and a JSON round trip that gives the same plan."""

from __future__ import annotations

import pytest
from sharding import sharded

import aoa
from aoa.plan import CopyTable, Plan, PlannedCopy


def table_and_rows():
    """Two keys planned alike (one list of keyed copies) and a third of its own."""
    alike = [(0, 0, (0, 0), (2, 3), (0, 0), None, ()), (1, 1, (0, 0), (2, 3), (0, 0), None, ()),
             (1, 0, (2, 0), (1, 3), (1, 0), (1, 0), ("bfloat16",))]
    other = [(0, 0, (0,), (4,), (0,), None, ())]
    table = CopyTable()
    table.add(0, alike, [5, 6])
    table.add(2, alike, [7, 8])
    table.add(4, other, [9])
    rows = [PlannedCopy(0, (0, 0), (2, 3), 5, (0, 0)), PlannedCopy(1, (0, 0), (2, 3), 6, (0, 0)),
            PlannedCopy(1, (2, 0), (1, 3), 5, (1, 0), (1, 0), ("bfloat16",)),
            PlannedCopy(2, (0, 0), (2, 3), 7, (0, 0)), PlannedCopy(3, (0, 0), (2, 3), 8, (0, 0)),
            PlannedCopy(3, (2, 0), (1, 3), 7, (1, 0), (1, 0), ("bfloat16",)),
            PlannedCopy(4, (0,), (4,), 9, (0,))]
    return table, rows


def test_a_table_reads_like_its_rows():
    table, rows = table_and_rows()
    assert len(table) == len(rows) == 7
    assert list(table) == rows
    assert [table[i] for i in range(len(rows))] == rows
    assert [table[i] for i in range(-len(rows), 0)] == rows
    assert table[2:5] == rows[2:5]
    assert table == rows and rows == table
    assert table != rows[:-1]
    for index in (7, -8):
        with pytest.raises(IndexError):
            table[index]


def test_a_planned_table_survives_json_and_equals_the_plan_read_back():
    source = {f"w.{i}": sharded(f"w.{i}", (4, 6), 2, 0) for i in range(3)}
    destination = {f"v.{i}": sharded(f"v.{i}", (6, 4), 2, 1, "bfloat16") for i in range(3)}
    plan = aoa.compile(["w.$LAYER_ID^T -> v.$LAYER_ID, dtype='bfloat16'"], source, destination)
    assert isinstance(plan.copies, CopyTable)
    back = Plan.loads(plan.dumps())
    assert isinstance(back.copies, list)
    assert back.copies == plan.copies and back == plan
    # destination shard r of v.i, columns 2r:2r+2 of w.i^T, is source shard r of w.i
    seen = {(plan.destinations[c.destination].key, plan.destinations[c.destination]
             .global_offset, plan.sources[c.source].key, plan.sources[c.source].global_offset,
             c.source_start, c.shape) for c in plan.copies}
    assert seen == {(f"v.{i}", (0, 2 * r), f"w.{i}", (2 * r, 0), (0, 0), (6, 2))
                    for i in range(3) for r in range(2)}
