"""The chunks of a key turned into its shards: the bulk checks (`shards_by_key`) against
the full ones, on chunk sets cut along an axis and then spoiled in one way or another.
Whatever the bulk checks accept gives exactly the shards the full checks give; whatever
they doubt goes to the full checks, so a fault gets the same message as ever."""

from __future__ import annotations

import itertools
from pathlib import Path
from unittest import mock

import numpy as np
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from aoa.passes.context import Shardings
from aoa.storage import chunks as chunks_module
from aoa.storage.chunks import (
    Chunk,
    ChunkColumns,
    as_stored,
    key_shards,
    shards_by_key,
    stored_shards,
)
from aoa.storage.formats import StoredShards


def outcome(read):
    """What ``read()`` returns, or the error it raises (its class, message and hint; an
    unknown dtype, which no format gives, is a KeyError either way)."""
    try:
        found = read()
    except Exception as error:
        return type(error), str(error), getattr(error, "hint", None)
    if isinstance(found, StoredShards):  # (its location dict, made where not made yet)
        return found._replace(locations=found.by_place())
    return found


def both_ways(read):
    fast = outcome(read)
    with mock.patch.object(chunks_module, "_well_typed", return_value=False):
        assert outcome(read) == fast
    return fast


@st.composite
def chunk_sets(draw) -> tuple[dict[str, list[Chunk]], dict[str, tuple[int, ...]] | None]:
    """Keys whose chunks are a shape cut along one axis (some replicated, in any order),
    each possibly spoiled: a box moved or resized, a dtype or rank changed, a box of the
    wrong type; perhaps a key stored as another is; with the global shapes, or without
    them, or with a wrong one."""
    found: dict[str, list[Chunk]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for key in draw(st.lists(st.sampled_from(["w", "a", "b.c", "é", "x\ud800"]), min_size=1,
                             max_size=3, unique=True)):
        rank = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=rank, max_size=rank)))
        axis = draw(st.integers(0, rank - 1)) if rank else 0
        cuts = sorted(draw(st.lists(st.integers(0, shape[axis]), max_size=3))) if rank else []
        edges = [0, *cuts, shape[axis] if rank else 1]
        boxes = []
        for start, stop in itertools.pairwise(edges):
            offset = tuple(start if n == axis else 0 for n in range(rank))
            size = tuple(stop - start if n == axis else shape[n] for n in range(rank))
            boxes.append([offset, size, "bfloat16"])
        boxes += [list(box) for box in draw(st.lists(st.sampled_from(boxes), max_size=2))]
        boxes = draw(st.permutations(boxes))
        spoil = draw(st.integers(0, 9))
        box = boxes[draw(st.integers(0, len(boxes) - 1))]
        if spoil == 0 and rank:
            box[0] = tuple(n + draw(st.sampled_from([-1, 1])) for n in box[0])
        elif spoil == 1 and rank:
            box[1] = tuple(n + draw(st.sampled_from([-1, 1, 2**62])) for n in box[1])
        elif spoil == 2:
            box[2] = draw(st.sampled_from(["float32", "nonsense", None]))
        elif spoil == 3:
            box[draw(st.integers(0, 1))] = (*box[0], 0)
        elif spoil == 4:
            box[draw(st.integers(0, 1))] = draw(st.sampled_from(
                [list(box[0]), tuple(map(np.int64, box[1])), tuple(map(bool, box[1])),
                 tuple(map(float, box[1]))]))
        found[key] = [Chunk(offset_size[1], offset_size[0], dtype, Path(f"f{i}"), i)
                      for i, (*offset_size, dtype) in enumerate(boxes)]
        shapes[key] = shape if spoil != 5 else (*shape[:-1], shape[-1] + 1) if rank else (1,)
    if draw(st.booleans()):  # a key stored as another is (the bulk checks remember those)
        like = draw(st.sampled_from(sorted(found)))
        found["like"] = [chunk._replace(location=-1 - n) for n, chunk in enumerate(found[like])]
        shapes["like"] = shapes[like]
    given_shapes = draw(st.sampled_from([None, shapes]))
    if spoil == 6:
        found["wrong type"] = [Chunk((1,), (0,), "float32", Path("f"), 0)]
        found[draw(st.sampled_from([0, b"k"]))] = found.pop("wrong type")  # type: ignore[index]
        given_shapes = None
    return found, given_shapes


@fuzz_settings
@given(case=chunk_sets())
def test_fuzz_chunks_make_the_same_shards_both_ways(case):
    found, shapes = case
    result = both_ways(lambda: shards_by_key(found, shapes))
    if isinstance(result, dict):  # one key at a time, as the formats other than safetensors
        for key, chunks in found.items():
            assert key_shards(key, chunks, None if shapes is None else shapes[key]) == \
                result[key]


@fuzz_settings
@given(case=chunk_sets(), data=st.data())
def test_fuzz_chunks_as_columns_make_the_same_shards(case, data):
    """Chunks given as columns, the keys' rows interleaved in any order, make what
    `shards_by_key` makes of each key's chunks in the order found (with the same locations),
    or raise the same error, both ways."""
    found, _ = case
    rows = data.draw(st.permutations([(key, *chunk) for key, chunks in found.items()
                                      for chunk in chunks]))
    grouped: dict = {}
    for key, *chunk in rows:
        grouped.setdefault(key, []).append(Chunk(*chunk))
    columns = ChunkColumns(*map(list, zip(*rows))) if rows else ChunkColumns(*[[]] * 6)
    expected = both_ways(lambda: as_stored(shards_by_key(grouped)))
    found = both_ways(lambda: stored_shards(columns))
    assert found == expected
    if isinstance(found, StoredShards):  # keys stored alike, as found, are sharded alike
        assert Shardings().of_keys(found.shards) == Shardings().of_keys(dict(found.shards))
        assert found.made is not None  # every shard, in order, located as looked up
        assert list(found.made[0]) == list(itertools.chain.from_iterable(found.shards.values()))
        assert found.made[1] == [found.locations[(shard.key, shard.global_offset)]
                                 for shard in found.made[0]]
    if chunks_module._well_typed(grouped, *columns[1:4]):  # as a format that checked them
        assert outcome(lambda: stored_shards(columns, typed=True)) == expected


def test_chunks_cut_along_one_axis_take_the_fast_path():
    """A whole tensor, replicas of it, and a tensor cut in three along its second axis:
    no key needs the full checks."""
    def chunk(offset, shape, where=0):
        return Chunk(shape, offset, "float32", Path("f"), where)

    found = {"whole": [chunk((0, 0), (2, 3)), chunk((0, 0), (2, 3), 1)],
             "cut": [chunk((0, 4), (2, 2)), chunk((0, 0), (2, 1)), chunk((0, 1), (2, 3))],
             "scalar": [chunk((), ())]}
    with mock.patch.object(chunks_module, "_checked_closely") as closely:
        shards = shards_by_key(found)
    closely.assert_not_called()
    assert [(s.global_offset, s.local_shape, s.global_shape, where)
            for s, where in shards["cut"]] == [((0, 0), (2, 1), (2, 6), 0),
                                                 ((0, 1), (2, 3), (2, 6), 0),
                                                 ((0, 4), (2, 2), (2, 6), 0)]
    assert [where for _, where in shards["whole"]] == [0]
    assert shards["scalar"][0][0].global_shape == ()
