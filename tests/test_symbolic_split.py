"""A split's parts are the pieces of its piece map inside each part's box, moved to the part's
start: whether a piece lies in one part (kept whole) or crosses the cuts (cut at each)."""

from __future__ import annotations

import pytest

from aoa import symbolic
from aoa.symbolic import Permute, PieceMap


def _by_boxes(piece_map: PieceMap, axis: int, parts: int) -> list[tuple]:
    """Each part as the intersection of its box, its target boxes made the part's own."""
    size = piece_map.shape[axis] // parts
    result = []
    for j in range(parts):
        lo = tuple(j * size if a == axis else 0 for a in range(len(piece_map.shape)))
        hi = tuple(lo[a] + size if a == axis else piece_map.shape[a]
                   for a in range(len(piece_map.shape)))
        result.append(tuple(
            (e.slot, e.source_lo, e.source_hi, tuple(map(lambda x, y: x - y, e.target_lo, lo)),
             tuple(map(lambda x, y: x - y, e.target_hi, lo)), e.ops, e.order)
            for e in symbolic.intersect(piece_map, lo, hi)))
    return result


def _maps() -> list[PieceMap]:
    shared: dict = {}
    whole = symbolic.whole((12, 6), shared)
    halves = symbolic.split(whole, 0, 2)
    thirds = symbolic.split(whole, 0, 3)
    unequal = symbolic.concat([thirds[0], halves[1]], [0, 1], 0)  # rows 4 and 6: 10
    swapped = symbolic.transpose(symbolic.concat([halves[1], halves[0]], [0, 1], 0),
                                 Permute((1, 0), "[1, 0]"))
    cast = symbolic.cast(symbolic.concat([thirds[2], thirds[1], thirds[0]], [0, 1, 2], 0),
                         "bfloat16")
    return [whole, *halves, unequal, swapped, cast]


@pytest.mark.parametrize("index", range(6))
@pytest.mark.parametrize("axis, parts", [(0, 2), (0, 3), (1, 2), (1, 3), (0, 1), (1, 6)])
def test_split_parts_are_the_pieces_in_each_parts_box(index, axis, parts):
    piece_map = _maps()[index]
    if piece_map.shape[axis] % parts:
        pytest.skip("not divisible")
    made = symbolic.split(piece_map, axis, parts)
    assert [m.pieces for m in made] == _by_boxes(piece_map, axis, parts)
    assert all(m.shape[axis] == piece_map.shape[axis] // parts for m in made)


def test_a_piece_in_the_first_part_is_kept_as_it_is():
    whole = symbolic.whole((8, 2), {})
    quarters = symbolic.split(whole, 0, 4)
    joined = symbolic.concat(quarters[:2], [0, 1], 0)
    first, second = symbolic.split(joined, 0, 2)
    assert first.pieces[0] is joined.pieces[0]
    assert second.pieces == ((1, (2, 0), (4, 2), (0, 0), (2, 2), (), None),)
