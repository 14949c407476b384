"""Mesh layouts: an axis split block by block (Megatron's gate/up rows under tensor
parallelism), written back as TOML and read again."""

from __future__ import annotations

import pytest
import tomllib
from fuzzing import NUMBERS, fuzz_settings, json_values
from hypothesis import given
from hypothesis import strategies as st

from aoa.errors import UsageError
from aoa.mesh_layout import layout_text, parse_mesh_layout, read_mesh_layout

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


def test_a_rule_written_with_one_bracket_says_to_write_two():
    text = '[mesh]\ntp = 2\n\n[rule]\nmatch = "fc1"\ntp = 0\n'
    with pytest.raises(UsageError) as caught:
        parse_mesh_layout(tomllib.loads(text))
    assert caught.value.message == ("<layout>: each rule begins with [[rule]], two brackets: "
                                    "'rule' is one table, not a list of rules")


@pytest.mark.parametrize(("number", "position"), [
    ("3", 0), ("4", 1), ("007", 1), ("0" * 30 + "3", 0), ("8", 1), ("9" * 5000, 1)])
def test_a_placement_reads_the_number_as_a_count(number, position):
    """Leading zeros count for nothing; a number past the count (a multi-token-prediction
    layer), however long, goes to the last position."""
    layout = parse_mesh_layout(tomllib.loads(
        '[mesh]\npp = 2\n\n[[rule]]\nmatch = "layers.*"\npp = { number_after = "layers.", '
        'of = 8 }\n'))
    key = f"layers.{number}.w"
    assert boxes(layout, {key: ((2,), "float32")}) == [
        [(key, (0,), (2,))] if rank == position else [] for rank in range(2)]


@pytest.mark.parametrize(("mesh", "message"), [
    ({"tp": True}, "mesh dimension tp = True must be a positive integer"),
    ({"tp": 10**30}, f"mesh dimension tp = {10**30} is more than 65536 ranks"),
    ({f"d{i}": 2 for i in range(100)}, "the mesh has over 2**63 ranks, more than 65536"),
])
def test_a_mesh_of_too_many_ranks_is_refused(mesh, message):
    with pytest.raises(UsageError) as caught:
        parse_mesh_layout({"mesh": mesh})
    assert caught.value.message == f"<layout>: {message}"


def test_a_number_longer_than_python_reads_is_refused(tmp_path):
    path = tmp_path / "layout.toml"
    path.write_text("[mesh]\ntp = " + "9" * 5000 + "\n")
    with pytest.raises(UsageError) as caught:
        read_mesh_layout(path)
    assert caught.value.message == f"{path}: not valid TOML: a number has more than 4300 digits"


_DIMENSIONS = st.sampled_from(["tp", "pp", "ep"])
_SMALL = st.integers(-1, 4)
_RULE_VALUES = st.one_of(
    _SMALL, NUMBERS, st.sampled_from(["first", "last", "middle", ""]),
    st.fixed_dictionaries({"axis": st.one_of(_SMALL, NUMBERS)},
                          optional={"blocks": st.one_of(_SMALL, NUMBERS), "x": _SMALL}),
    st.fixed_dictionaries({"number_after": st.sampled_from(["layers.", "experts.", "", "w"])},
                          optional={"of": st.one_of(_SMALL, NUMBERS, st.text(max_size=2))}),
    json_values())
_RULES = st.lists(st.one_of(
    st.dictionaries(_DIMENSIONS, _RULE_VALUES, max_size=3).flatmap(
        lambda rule: st.sampled_from(["layers.*", "*", "layers.[0-1].w", "experts.*", "[", 7])
        .map(lambda match: {"match": match, **rule})),
    json_values()), max_size=3)
_OUTPUTS = st.dictionaries(
    st.sampled_from(["layers.0.w", "layers.1.w", "layers.12.experts.3.w", "w", "layers.w",
                     "layers.1.w.moment1_0", "w.beta1_pow_acc_0"]),
    st.tuples(st.lists(st.integers(0, 12), max_size=3).map(tuple),
              st.sampled_from(["float32", None])), min_size=1, max_size=4)


@fuzz_settings
@given(st.one_of(st.dictionaries(_DIMENSIONS, st.one_of(_SMALL, NUMBERS, json_values()),
                                 max_size=3), json_values()),
       _RULES, _OUTPUTS, st.booleans())
def test_fuzz_layouts_place_or_raise_a_usage_error(mesh, rules, outputs, strict):
    """Whatever the layout holds, reading it and placing any outputs either works, every
    shard inside its tensor, or raises a UsageError."""
    try:
        shards = parse_mesh_layout({"mesh": mesh, "rule": rules}).shards(outputs,
                                                                          strict=strict)
    except UsageError:
        return
    for key, found in shards.by_key.items():
        shape = outputs[key][0]
        for shard in found:
            assert all(start >= 0 and start + size <= total for start, size, total in
                       zip(shard.global_offset, shard.local_shape, shape, strict=True))
