"""Mesh layouts: an axis split block by block (Megatron's gate/up rows under tensor
parallelism), written back as TOML and read again."""

from __future__ import annotations

import pytest
import tomllib

from aoa.errors import UsageError
from aoa.mesh_layout import layout_text, parse_mesh_layout

BLOCKED = """\
[mesh]
pp = 2
tp = 2

[[rule]]
match = "fc1"
tp = { axis = 0, blocks = 2 }

[[rule]]
match = "fc2"
tp = 1
"""


def boxes(layout, outputs):
    shards = layout.shards(outputs)
    listed = shards.listed()
    return [[(listed[i].key, listed[i].global_offset, listed[i].local_shape) for i in rank]
            for rank in shards.ranks]


def test_a_blocked_axis_gives_each_rank_its_part_of_every_block():
    layout = parse_mesh_layout(tomllib.loads(BLOCKED))
    got = boxes(layout, {"fc1": ((8, 3), "float32"), "fc2": ((3, 4), "float32")})
    rank0 = [("fc1", (0, 0), (2, 3)), ("fc1", (4, 0), (2, 3)), ("fc2", (0, 0), (3, 2))]
    rank1 = [("fc1", (2, 0), (2, 3)), ("fc1", (6, 0), (2, 3)), ("fc2", (0, 2), (3, 2))]
    assert got == [rank0, rank1, rank0, rank1]  # pp replicates: ranks 2, 3 as 0, 1


def test_a_blocked_axis_nests_its_dimensions_within_each_block():
    layout = parse_mesh_layout(tomllib.loads(
        '[mesh]\nep = 2\ntp = 2\n\n[[rule]]\nmatch = "*"\nep = { axis = 0, blocks = 2 }\n'
        'tp = { axis = 0, blocks = 2 }\n'))
    got = boxes(layout, {"w": ((16,), "float32")})
    assert got == [[("w", (o,), (2,)), ("w", (o + 8,), (2,))] for o in (0, 2, 4, 6)]


def test_layout_text_writes_blocks_back():
    layout = parse_mesh_layout(tomllib.loads(BLOCKED))
    assert layout_text(layout) == BLOCKED
    assert parse_mesh_layout(tomllib.loads(layout_text(layout))) == layout


@pytest.mark.parametrize("rule, message", [
    ('tp = { axis = 0, blocks = 0 }', "an axis split block by block is { axis = A, blocks = B } "
                                      "with A from 0 and B a positive count"),
    ('tp = { axis = 0, parts = 2 }', "an axis split block by block is { axis = A, blocks = B } "
                                     "with A from 0 and B a positive count"),
])
def test_a_bad_blocked_axis_is_refused(rule, message):
    with pytest.raises(UsageError) as caught:
        parse_mesh_layout(tomllib.loads(f'[mesh]\ntp = 2\n\n[[rule]]\nmatch = "w"\n{rule}\n'))
    assert caught.value.message == f"<layout>: rule 1 ('w'): tp: {message}"


def test_blocks_that_do_not_split_evenly_are_refused():
    layout = parse_mesh_layout(tomllib.loads(BLOCKED))
    with pytest.raises(UsageError) as caught:
        layout.shards({"fc1": ((6, 3), "float32")})
    assert caught.value.message == ("<layout>: 'fc1' has 6 on axis 0, which does not split "
                                    "into 2 blocks of 2 equal shards")
