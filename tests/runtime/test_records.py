"""`aoa._core.new_records` / `new_record_groups`: shard descriptions made in bulk in C++ are
the objects the class's constructor makes, and bad columns are refused, not misread."""

from __future__ import annotations

import dataclasses

import pytest

from aoa import _core
from aoa.layout import ShardDesc

FIELDS = tuple(field.name for field in dataclasses.fields(ShardDesc))
ROWS = [("a", (2, 3), (4, 3), (0, 0), "bfloat16"), ("a", (2, 3), (4, 3), (2, 0), "bfloat16"),
        ("b", (5,), (5,), (0,), None)]


def test_records_equal_the_constructors_objects() -> None:
    made = _core.new_records(ShardDesc, FIELDS, [iter(column) for column in zip(*ROWS)])
    expected = [ShardDesc(*row) for row in ROWS]
    assert made == expected
    assert [type(shard) for shard in made] == [ShardDesc] * 3
    assert list(map(hash, made)) == list(map(hash, expected))
    assert list(map(repr, made)) == list(map(repr, expected))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].key = "c"  # type: ignore[misc]
    assert ShardDesc.many_unchecked(*zip(*ROWS)) == expected


def test_groups_equal_the_constructors_objects() -> None:
    rows = [[row[1:] for row in ROWS[:2]], [ROWS[2][1:]], []]
    made = _core.new_record_groups(ShardDesc, FIELDS, ["a", "b", "c"], rows)
    assert made == [[ShardDesc(*ROWS[0]), ShardDesc(*ROWS[1])], [ShardDesc(*ROWS[2])], []]
    info = ShardDesc.grouped_unchecked(["a", "b"], rows[:2])
    assert info == {"a": made[0], "b": made[1]}


@pytest.mark.parametrize(("columns", "message"), [
    ([["a", "b"], [(1,)], [(1,)], [(0,)], [None]], "column 0 is longer than the others"),
    ([["a"], [(1,), (1,)], [(1,)], [(0,)], [None]], "column 1 is longer than column 0"),
    ([["a"], [(1,)], [(1,)], [(0,)]], "one column per field: 5 fields, 4 columns"),
])
def test_columns_of_other_lengths_are_refused(columns: list, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        _core.new_records(ShardDesc, FIELDS, columns)


def test_bad_rows_and_fields_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^row 1 of group 0 is not a tuple of 4 values$"):
        _core.new_record_groups(ShardDesc, FIELDS, ["a"], [[((1,), (1,), (0,), None), (1,)]])
    with pytest.raises(ValueError, match=r"^2 heads for 1 groups of rows$"):
        _core.new_record_groups(ShardDesc, FIELDS, ["a", "b"], [[]])
    with pytest.raises(TypeError, match=r"^numel is not a slot of ShardDesc$"):
        _core.new_records(ShardDesc, ("numel",), [[]])
    with pytest.raises(AttributeError):
        _core.new_records(ShardDesc, ("nothing",), [[]])
