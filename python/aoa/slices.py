"""The slice algebra of symbolic tensors (spec 6.2), memoized by structure.

A symbolic tensor is a ``Layout`` (its shape and ordered pieces, each "this box of me is that
box of source slot k, permuted and cast like so") plus the tuple of source keys its slots
stand for. Models repeat one structure thousands of times (every layer, every expert), so
layouts are shared and every operation on a layout is computed once and remembered: the
thousandth expert costs a dictionary lookup, not a re-computation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

Box = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Permute:
    """A permutation step: result axis i = input axis ``axes[i]``; ``text`` as Paddle lists it."""

    axes: tuple[int, ...]
    text: str


Op = Permute | str  # a str is a cast to that dtype


class Piece(NamedTuple):
    """``tensor[target box] = ops(source[keys[slot]][source box])``; ``order`` composes the
    permutations: target axis i = source axis order[i] (None: the identity)."""

    slot: int
    source_lo: Box
    source_hi: Box
    target_lo: Box
    target_hi: Box
    ops: tuple[Op, ...]
    order: tuple[int, ...] | None


class Layout:
    """Shape and pieces of a family of tensors; results of operations are memoized on it."""

    __slots__ = ("memo", "pieces", "shape")

    def __init__(self, shape: tuple[int, ...], pieces: tuple[Piece, ...]) -> None:
        self.shape = shape
        self.pieces = pieces
        self.memo: dict = {}

    def __repr__(self) -> str:
        return f"Layout({list(self.shape)}, {len(self.pieces)} pieces)"


def whole(shape: tuple[int, ...], shared: dict[tuple[int, ...], Layout]) -> Layout:
    """The layout of a source tensor: one piece covering everything, one per shape in
    ``shared`` (a compilation's own, so memos do not outlive it)."""
    layout = shared.get(shape)
    if layout is None:
        zeros = (0,) * len(shape)
        layout = shared[shape] = Layout(shape, (Piece(0, zeros, shape, zeros, shape, (), None),))
    return layout


def _unpermute(lo: Box, hi: Box, order: Sequence[int]) -> tuple[Box, Box]:
    new_lo, new_hi = [0] * len(order), [0] * len(order)
    for i, a in enumerate(order):
        new_lo[a], new_hi[a] = lo[i], hi[i]
    return tuple(new_lo), tuple(new_hi)


def _parts_met(piece: Piece, axis: int, size: int, parts: int) -> range:
    """The parts of extent ``size`` along ``axis`` that ``piece`` has elements in."""
    lo, hi = piece.target_lo[axis], piece.target_hi[axis]
    if size == 0 or lo >= hi:
        return range(0)
    return range(lo // size, min((hi - 1) // size + 1, parts))


def split_pieces(layout: Layout, axis: int, parts: int) -> int:
    """How many pieces ``split`` makes in all, worked out before making them."""
    size = layout.shape[axis] // parts
    return sum(len(_parts_met(p, axis, size, parts)) for p in layout.pieces)


def split(layout: Layout, axis: int, parts: int) -> list[Layout]:
    """``parts`` equal pieces along ``axis`` (the caller checked divisibility). Each piece
    visits only the parts it meets, so the time is that of the pieces made."""
    key = ("split", axis, parts)
    result = layout.memo.get(key)
    if result is not None:
        return result
    size = layout.shape[axis] // parts
    shape = layout.shape[:axis] + (size,) + layout.shape[axis + 1:]
    per_part: list[list[Piece]] = [[] for _ in range(parts)]
    for p in layout.pieces:
        t_lo, t_hi = p.target_lo[axis], p.target_hi[axis]
        order = p.order
        if order is None:
            whole_lo, whole_hi = p.source_lo, p.source_hi
        else:
            whole_lo = tuple(p.source_lo[a] for a in order)
            whole_hi = tuple(p.source_hi[a] for a in order)
        for j in _parts_met(p, axis, size, parts):
            start, stop = j * size, (j + 1) * size
            lo, hi = max(t_lo, start), min(t_hi, stop)
            a_lo = whole_lo[axis] + lo - t_lo
            s_lo = whole_lo[:axis] + (a_lo,) + whole_lo[axis + 1:]
            s_hi = whole_hi[:axis] + (a_lo + hi - lo,) + whole_hi[axis + 1:]
            if order is not None:
                s_lo, s_hi = _unpermute(s_lo, s_hi, order)
            per_part[j].append(Piece(p.slot, s_lo, s_hi,
                                     p.target_lo[:axis] + (lo - start,) + p.target_lo[axis + 1:],
                                     p.target_hi[:axis] + (hi - start,) + p.target_hi[axis + 1:],
                                     p.ops, order))
    result = [Layout(shape, tuple(pieces)) for pieces in per_part]
    layout.memo[key] = result
    return result


def concat(layouts: Sequence[Layout], slot_offsets: Sequence[int], axis: int) -> Layout:
    """Layouts side by side along ``axis``; input i's slots move up by ``slot_offsets[i]``."""
    first = layouts[0]
    key = ("concat", axis, tuple(map(id, layouts)), tuple(slot_offsets))
    hit = first.memo.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], layouts)):
        return hit[1]
    pieces = []
    offset = 0
    for layout, slot_offset in zip(layouts, slot_offsets):
        for p in layout.pieces:
            pieces.append(Piece(p.slot + slot_offset, p.source_lo, p.source_hi,
                                p.target_lo[:axis] + (p.target_lo[axis] + offset,)
                                + p.target_lo[axis + 1:],
                                p.target_hi[:axis] + (p.target_hi[axis] + offset,)
                                + p.target_hi[axis + 1:], p.ops, p.order))
        offset += layout.shape[axis]
    result = Layout(first.shape[:axis] + (offset,) + first.shape[axis + 1:], tuple(pieces))
    first.memo[key] = (tuple(layouts), result)  # keeps the inputs alive: ids stay unique
    return result


def transpose(layout: Layout, permute: Permute) -> Layout:
    key = ("permute", permute)
    result = layout.memo.get(key)
    if result is None:
        axes = permute.axes
        pieces = tuple(
            Piece(p.slot, p.source_lo, p.source_hi, tuple(p.target_lo[a] for a in axes),
                  tuple(p.target_hi[a] for a in axes), (*p.ops, permute),
                  tuple(axes) if p.order is None else tuple(p.order[a] for a in axes))
            for p in layout.pieces)
        result = layout.memo[key] = Layout(tuple(layout.shape[a] for a in axes), pieces)
    return result


def cast(layout: Layout, dtype: str) -> Layout:
    key = ("cast", dtype)
    result = layout.memo.get(key)
    if result is None:
        result = layout.memo[key] = Layout(
            layout.shape, tuple(p._replace(ops=(*p.ops, dtype)) for p in layout.pieces))
    return result


class Entry(NamedTuple):
    """``target[target box] = ops(source[slot][source box])`` for one asked box."""

    slot: int
    target_lo: Box
    target_hi: Box
    source_lo: Box
    source_hi: Box
    ops: tuple[Op, ...]
    order: tuple[int, ...] | None


def intersect(layout: Layout, lo: Box, hi: Box) -> list[Entry]:
    """The pieces of ``layout`` inside the box [lo, hi), in piece order (spec 6.7 step 3)."""
    key = ("box", lo, hi)
    result = layout.memo.get(key)
    if result is not None:
        return result
    result = []
    for p in layout.pieces:
        i_lo = tuple(map(max, lo, p.target_lo))
        i_hi = tuple(map(min, hi, p.target_hi))
        if any(a >= b for a, b in zip(i_lo, i_hi)):
            continue
        order = p.order
        if order is None:
            s_lo = tuple(s + a - t for s, a, t in zip(p.source_lo, i_lo, p.target_lo))
            s_hi = tuple(s + b - a for s, a, b in zip(s_lo, i_lo, i_hi))
        else:
            s_lo_list, s_hi_list = list(p.source_lo), list(p.source_hi)
            for i, axis in enumerate(order):
                s_lo_list[axis] = p.source_lo[axis] + i_lo[i] - p.target_lo[i]
                s_hi_list[axis] = s_lo_list[axis] + i_hi[i] - i_lo[i]
            s_lo, s_hi = tuple(s_lo_list), tuple(s_hi_list)
        result.append(Entry(p.slot, i_lo, i_hi, s_lo, s_hi, p.ops, order))
    layout.memo[key] = result
    return result
