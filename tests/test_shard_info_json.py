"""Shard-info JSON (``--source``/``--destination`` files, case.json) is read in bulk where it
is plain; these check that the bulk path makes exactly what checking each description makes,
and refuses with the same message whatever is wrong."""

from __future__ import annotations

import json

import pytest
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

import aoa
from aoa.errors import quote
from aoa.layout import ShardDesc, normalize_shard_info
from aoa.limits import MAX_BYTES

numbers = st.one_of(st.integers(-2, 9), st.sampled_from([True, 2.0, "3", None, 2**62]))
dtypes = st.sampled_from([None, "float32", "bfloat16", "float8_e4m3fn", "float33", 5, ["x"]])


@st.composite
def shard_dicts(draw, key):
    rank = draw(st.integers(0, 3))
    total = draw(st.lists(st.integers(0, 9), min_size=rank, max_size=rank))
    offset = [draw(st.integers(0, t)) for t in total]
    local = [draw(st.integers(0, t - o)) for o, t in zip(offset, total)]
    shard = {"key": key, "local_shape": local, "global_shape": total,
             "global_offset": offset, "dtype": draw(dtypes)}
    if draw(st.integers(0, 3)) == 0:  # something unusual about it
        field = draw(st.sampled_from(["local_shape", "global_shape", "global_offset", "key"]))
        if field == "key":
            shard["key"] = draw(st.sampled_from(["other", 3, "k\ud800"]))
        elif shard[field] and draw(st.booleans()):
            shard[field][draw(st.integers(0, len(shard[field]) - 1))] = draw(numbers)
        else:
            shard[field] = draw(st.sampled_from([(1, 2), "ab", 7, [1] * 4]))
    if draw(st.integers(0, 9)) == 0:
        del shard[draw(st.sampled_from(["key", "local_shape", "global_shape", "dtype"]))]
    return shard


@st.composite
def shard_infos(draw):
    keys = draw(st.lists(st.sampled_from(["a", "b.weight", "c\u00e9", "d\ud800"]),
                         unique=True, max_size=3))
    return {key: draw(st.lists(shard_dicts(key), max_size=3)) for key in keys}


def one_by_one(info: dict) -> dict[str, list[ShardDesc]] | str:
    """Each description made and checked on its own (what the bulk path stands in for);
    the message of the first refusal, in the order the bulk path meets them."""
    try:
        result = {}
        for key, shards in info.items():
            made = [ShardDesc.from_json(shard) for shard in shards]
            if not made:
                return f"destination shard info lists no shard of {quote(key)}"
            for shard in made:
                if shard.key != key:
                    raise aoa.UsageError(f"destination shard listed under {quote(key)} "
                                         f"describes {quote(shard.key)}")
            result[key] = made
        return result
    except aoa.UsageError as error:
        return error.message


def bulk(info: dict) -> dict[str, list[ShardDesc]] | str:
    try:
        return normalize_shard_info(json.loads(json.dumps(info)), "destination")
    except aoa.UsageError as error:
        return error.message


@fuzz_settings
@given(shard_infos())
def test_bulk_reading_makes_and_refuses_what_checking_each_does(info):
    expected = one_by_one(json.loads(json.dumps(info)))
    found = bulk(info)
    assert found == expected
    if isinstance(found, dict):
        for shards in found.values():
            for shard in shards:
                assert all(type(n) is int for n in shard.local_shape + shard.global_shape
                           + shard.global_offset)
                assert type(shard.local_shape) is tuple


def test_a_shape_too_big_is_refused_in_bulk_too():
    info = {"w": [{"key": "w", "local_shape": [1], "global_shape": [MAX_BYTES],
                   "global_offset": [0], "dtype": "float32"}]}
    with pytest.raises(aoa.UsageError) as caught:
        normalize_shard_info(info, "destination")
    assert caught.value.message == ("shard of 'w': its global shape [9223372036854775807] "
                                    "would hold more than 9223372036854775807 bytes (2**63 - 1)")


@pytest.mark.parametrize("change", [
    {"local_shape": [-1, 4]}, {"global_offset": [-1, 0]}, {"local_shape": [3, 4]},
    {"global_offset": [0, 1]}, {"global_shape": [4]}, {"local_shape": [True, 4]},
    {"global_offset": [0.0, 0]}, {"dtype": "float33"}, {"dtype": 4}, {"dtype": ["x"]}, {"key": "v"},
])
def test_each_kind_of_wrong_shard_among_right_ones_is_refused_as_alone(change):
    right = {"key": "w", "local_shape": [2, 4], "global_shape": [4, 4],
             "global_offset": [2, 0], "dtype": "bfloat16"}
    info = {"w": [dict(right, global_offset=[0, 0]), dict(right, **change)]}
    expected = one_by_one(info)
    assert isinstance(expected, str)
    assert bulk(info) == expected
