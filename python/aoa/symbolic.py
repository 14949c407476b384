"""Symbolic tensors, what shape propagation makes of a program, and their slice algebra
(spec 6.1-6.2), memoized by structure.

A symbolic tensor is a ``PieceMap`` (its shape and ordered pieces, each "this box of me is
that box of source slot k, permuted and cast like so") plus the tuple of source keys its
slots stand for. Models repeat one structure thousands of times (every layer, every
expert), so piece maps are shared and every operation on one is computed once and
remembered in it: the thousandth expert costs a dictionary lookup, not a re-computation.
A piece map is a value (equal shape and pieces, equal maps), and so is every memo key, so
what is remembered can never be wrong for the map it is asked of.
"""

from __future__ import annotations

from collections.abc import ItemsView, Mapping, Sequence
from dataclasses import dataclass, field
from operator import add, itemgetter, le, lt, sub
from typing import TYPE_CHECKING, NamedTuple

from aoa.layout import BETA_POW_SUFFIXES, ShardDesc, split_optimizer_suffix

if TYPE_CHECKING:
    from aoa.ir import Program, Statement

Box = tuple[int, ...]
#: makes a NamedTuple of its fields without the Python-level __new__ (pieces by the million)
_new_tuple = tuple.__new__


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


class PieceMap:
    """Shape and pieces of a family of tensors, a value; the results of operations on it
    are remembered in ``memo``, keyed by the operation and its arguments (values too)."""

    __slots__ = ("_hash", "memo", "pieces", "shape")

    def __init__(self, shape: tuple[int, ...], pieces: tuple[Piece, ...]) -> None:
        self.shape = shape
        self.pieces = pieces
        self.memo: dict = {}
        self._hash: int | None = None

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, PieceMap):
            return NotImplemented
        return self.shape == other.shape and self.pieces == other.pieces

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash((self.shape, self.pieces))
        return self._hash

    def __repr__(self) -> str:
        return f"PieceMap({list(self.shape)}, {len(self.pieces)} pieces)"


def whole(shape: tuple[int, ...], shared: dict[tuple[int, ...], PieceMap]) -> PieceMap:
    """The piece map of a source tensor: one piece covering everything, one per shape in
    ``shared`` (a compilation's own, so memos do not outlive it)."""
    piece_map = shared.get(shape)
    if piece_map is None:
        zeros = (0,) * len(shape)
        piece_map = shared[shape] = PieceMap(
            shape, (Piece(0, zeros, shape, zeros, shape, (), None),))
    return piece_map


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


def split_pieces(piece_map: PieceMap, axis: int, parts: int) -> int:
    """How many pieces ``split`` makes in all, worked out before making them."""
    size = piece_map.shape[axis] // parts
    return sum(len(_parts_met(p, axis, size, parts)) for p in piece_map.pieces)


def split(piece_map: PieceMap, axis: int, parts: int) -> list[PieceMap]:
    """``parts`` equal pieces along ``axis`` (the caller checked divisibility). Each piece
    visits only the parts it meets, so the time is that of the pieces made."""
    key = ("split", axis, parts)
    result = piece_map.memo.get(key)
    if result is not None:
        return result
    size = piece_map.shape[axis] // parts
    shape = piece_map.shape[:axis] + (size,) + piece_map.shape[axis + 1:]
    per_part: list[list[Piece]] = [[] for _ in range(parts)]
    after = axis + 1
    for p in piece_map.pieces:
        target_lo, target_hi, order = p.target_lo, p.target_hi, p.order
        t_lo, t_hi = target_lo[axis], target_hi[axis]
        if t_lo < t_hi and size:
            first = t_lo // size
            if first == (t_hi - 1) // size < parts:
                # the whole piece in one part (a split along the cuts of a concat): its
                # source boxes as they are, its target boxes moved to the part's start
                start = first * size
                per_part[first].append(p if not start else _new_tuple(Piece, (
                    p.slot, p.source_lo, p.source_hi,
                    target_lo[:axis] + (t_lo - start,) + target_lo[after:],
                    target_hi[:axis] + (t_hi - start,) + target_hi[after:], p.ops, order)))
                continue
        if order is None:
            whole_lo, whole_hi = p.source_lo, p.source_hi
        else:
            whole_lo = tuple([p.source_lo[a] for a in order])
            whole_hi = tuple([p.source_hi[a] for a in order])
        # each box is its piece's but along ``axis``: the axes around it cut once a piece
        before_lo, after_lo = target_lo[:axis], target_lo[after:]
        before_hi, after_hi = target_hi[:axis], target_hi[after:]
        source_before_lo, source_after_lo = whole_lo[:axis], whole_lo[after:]
        source_before_hi, source_after_hi = whole_hi[:axis], whole_hi[after:]
        source_shift = whole_lo[axis] - t_lo
        slot, ops = p.slot, p.ops
        for j in _parts_met(p, axis, size, parts):
            start = j * size
            stop = start + size
            lo = t_lo if t_lo > start else start
            hi = t_hi if t_hi < stop else stop
            a_lo = source_shift + lo
            s_lo = source_before_lo + (a_lo,) + source_after_lo
            s_hi = source_before_hi + (a_lo + hi - lo,) + source_after_hi
            if order is not None:
                s_lo, s_hi = _unpermute(s_lo, s_hi, order)
            per_part[j].append(_new_tuple(Piece, (
                slot, s_lo, s_hi, before_lo + (lo - start,) + after_lo,
                before_hi + (hi - start,) + after_hi, ops, order)))
    result = [PieceMap(shape, tuple(pieces)) for pieces in per_part]
    piece_map.memo[key] = result
    return result


def concat(piece_maps: Sequence[PieceMap], slot_offsets: Sequence[int], axis: int
           ) -> PieceMap:
    """Piece maps side by side along ``axis``; input i's slots move up by
    ``slot_offsets[i]``."""
    first = piece_maps[0]
    key = ("concat", axis, tuple(piece_maps[1:]), tuple(slot_offsets))
    result = first.memo.get(key)
    if result is not None:
        return result
    pieces: list[Piece] = []
    offset = 0
    for piece_map, slot_offset in zip(piece_maps, slot_offsets):
        if not offset and not slot_offset:  # the first input's pieces stay as they are
            pieces += piece_map.pieces
            offset = piece_map.shape[axis]
            continue
        for p in piece_map.pieces:
            pieces.append(_new_tuple(Piece, (
                p.slot + slot_offset, p.source_lo, p.source_hi,
                p.target_lo[:axis] + (p.target_lo[axis] + offset,) + p.target_lo[axis + 1:],
                p.target_hi[:axis] + (p.target_hi[axis] + offset,) + p.target_hi[axis + 1:],
                p.ops, p.order)))
        offset += piece_map.shape[axis]
    result = first.memo[key] = PieceMap(
        first.shape[:axis] + (offset,) + first.shape[axis + 1:], tuple(pieces))
    return result


def transpose(piece_map: PieceMap, permute: Permute) -> PieceMap:
    key = ("permute", permute)
    result = piece_map.memo.get(key)
    if result is None:
        axes = tuple(permute.axes)
        # a box's items in the order of ``axes``, as one tuple at C speed (of one axis or
        # none, the box itself)
        take = itemgetter(*axes) if len(axes) > 1 else tuple
        pieces = tuple([
            _new_tuple(Piece, (
                p.slot, p.source_lo, p.source_hi, take(p.target_lo), take(p.target_hi),
                (*p.ops, permute), axes if p.order is None else take(p.order)))
            for p in piece_map.pieces])
        result = piece_map.memo[key] = PieceMap(take(piece_map.shape), pieces)
    return result


def cast(piece_map: PieceMap, dtype: str) -> PieceMap:
    key = ("cast", dtype)
    result = piece_map.memo.get(key)
    if result is None:
        result = piece_map.memo[key] = PieceMap(
            piece_map.shape, tuple([_new_tuple(Piece, (*p[:5], (*p.ops, dtype), p.order))
                                    for p in piece_map.pieces]))
    return result


def dtype_after(ops: Sequence[Op], source_dtype: str | None) -> str | None:
    """The dtype of a piece after its casts."""
    for op in reversed(ops):
        if isinstance(op, str):
            return op
    return source_dtype


class Entry(NamedTuple):
    """``target[target box] = ops(source[keys[slot]][source box])`` for one asked box of a
    tensor (global boxes; what Paddle's ShardMappingEntry says, with the key as a slot)."""

    slot: int
    target_lo: Box
    target_hi: Box
    source_lo: Box
    source_hi: Box
    ops: tuple[Op, ...]
    order: tuple[int, ...] | None


def intersect(piece_map: PieceMap, lo: Box, hi: Box) -> list[Entry]:
    """The pieces of ``piece_map`` inside the box [lo, hi), in piece order (spec 6.7
    step 3)."""
    key = ("box", lo, hi)
    result = piece_map.memo.get(key)
    if result is not None:
        return result
    result = []
    for p in piece_map.pieces:
        if p.target_lo == lo and p.target_hi == hi:
            # the box is this piece's own (a whole tensor asked whole, the usual shard of a
            # small model): its own boxes, told by two comparisons of tuples
            if all(map(lt, lo, hi)):
                result.append(_new_tuple(Entry, (p.slot, p.target_lo, p.target_hi,
                                                 p.source_lo, p.source_hi, p.ops, p.order)))
            continue
        # most pieces of a big map lie outside the box: told apart before any tuple is made
        if not (all(map(lt, lo, p.target_hi)) and all(map(lt, p.target_lo, hi))):
            continue
        if (all(map(le, lo, p.target_lo)) and all(map(le, p.target_hi, hi))
                and all(map(lt, p.target_lo, p.target_hi))):
            # all of a piece inside the box: its own boxes (a source box is its target
            # box's shape in the source's axes)
            result.append(_new_tuple(Entry, (p.slot, p.target_lo, p.target_hi, p.source_lo,
                                             p.source_hi, p.ops, p.order)))
            continue
        i_lo = tuple(map(max, lo, p.target_lo))
        i_hi = tuple(map(min, hi, p.target_hi))
        if not all(map(lt, i_lo, i_hi)):
            continue
        order = p.order
        if order is None:
            s_lo = tuple(map(add, p.source_lo, map(sub, i_lo, p.target_lo)))
            s_hi = tuple(map(add, s_lo, map(sub, i_hi, i_lo)))
        else:
            s_lo_list, s_hi_list = list(p.source_lo), list(p.source_hi)
            for i, axis in enumerate(order):
                s_lo_list[axis] = p.source_lo[axis] + i_lo[i] - p.target_lo[i]
                s_hi_list[axis] = s_lo_list[axis] + i_hi[i] - i_lo[i]
            s_lo, s_hi = tuple(s_lo_list), tuple(s_hi_list)
        result.append(_new_tuple(Entry, (p.slot, i_lo, i_hi, s_lo, s_hi, p.ops, order)))
    piece_map.memo[key] = result
    return result


# -- tensors ---------------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Tensor:
    """A symbolic tensor: a shared piece map plus the source keys its slots stand for.

    A tensor is an object, not a value: names bound to the same tensor are aliases of it
    (`a -> b, axis=0` with one name a side), and its ``uses`` count its readers."""

    piece_map: PieceMap
    keys: tuple[str, ...]
    dtype: str | None  # the source dtype, as Paddle records it (casts do not change it)
    uses: int = 0
    name: str = ""

    @property
    def shape(self) -> tuple[int, ...]:
        return self.piece_map.shape

    def pieces(self) -> list[tuple[str, Piece]]:
        return [(self.keys[p.slot], p) for p in self.piece_map.pieces]

    def source_keys(self) -> set[str]:
        return {self.keys[p.slot] for p in self.piece_map.pieces}


class InputTensors:
    """One tensor per model-state key of the source (spec 6.1, quirk Q15 included), made
    when first asked for: the instances share_instances set aside never ask for theirs.

    A key the source holds itself gets its own shape and dtype; any other question (a key
    that only optimizer states stand for, all the items) makes them all in Paddle's order,
    keeping the tensors already handed out."""

    def __init__(self, source: Mapping[str, Sequence[ShardDesc]]) -> None:
        self._source = source
        self._made: dict[str, Tensor] = {}
        self._piece_maps: dict[tuple[int, ...], PieceMap] = {}
        self._complete = False

    def get(self, key: str) -> Tensor | None:
        tensor = self._made.get(key)
        if tensor is None:
            shards = self._source.get(key)
            if shards and split_optimizer_suffix(key)[1] is None:
                tensor = self._made[key] = self._make(key, shards[0].global_shape,
                                                      shards[0].dtype)
            elif not self._complete:
                return self._all().get(key)
        return tensor

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def __getitem__(self, key: str) -> Tensor:
        tensor = self.get(key)
        if tensor is None:
            raise KeyError(key)
        return tensor

    def items(self) -> ItemsView[str, Tensor]:
        return self._all().items()

    def _make(self, key: str, shape, dtype: str | None) -> Tensor:
        return Tensor(whole(tuple(shape), self._piece_maps), (key,), dtype, name=key)

    def _all(self) -> dict[str, Tensor]:
        if not self._complete:
            made, self._made = self._made, {}
            dtype = None
            for key in sorted(self._source):
                shards = self._source[key]
                model_key, suffix = split_optimizer_suffix(key)
                if suffix is None:
                    dtype = shards[0].dtype
                if model_key in self._made or suffix in BETA_POW_SUFFIXES:
                    continue
                self._made[model_key] = made.get(model_key) or self._make(
                    model_key, shards[0].global_shape, dtype)
            self._complete = True
        return self._made


@dataclass
class SymbolicTensors:
    """What shape propagation makes of a program: the tensor of every output, and what
    planning needs to explain itself."""

    #: the program whose statements made them
    program: Program
    inputs: InputTensors
    #: destination key (without an optimizer suffix) -> its tensor (None: `_ -> key`)
    outputs: dict[str, Tensor | None]
    #: every name's latest binding (intermediates)
    bound: dict[str, Tensor] = field(default_factory=dict)
    #: `X -> _`: source key -> the statement that deleted it (removal is global, Q27)
    removed: dict[str, Statement] = field(default_factory=dict)
    #: `_ -> Y`: destinations that get no bytes
    added: set[str] = field(default_factory=set)
    #: destination key -> the statement that wrote it last (for error messages)
    writers: dict[str, Statement] = field(default_factory=dict)
