"""The Plan: plain data saying, per destination shard, which source bytes to copy where.

It is what `aoa compile` writes, what `aoa explain` describes, and all that the executor
reads: shard descriptions on both sides and a sequence of copies with boxes, an axis order
(permutation) and rounding steps (a CopyTable as planned, a list as read from JSON: they
compare equal). The runtime lowers it to byte offsets and strides (`aoa.runtime.lower`);
nothing here knows how copies run.
"""

from __future__ import annotations

import bisect
import io
import itertools
import json
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, overload

from aoa.dtypes import is_known
from aoa.errors import UsageError, quote
from aoa.inputs import load_json
from aoa.layout import ShardDesc
from aoa.printer import Printer

FORMAT = "aoa-plan/1"


class PlannedCopy(NamedTuple):
    """``destinations[destination][destination_start : +shape] =
    cast(transpose(sources[source][source_start : +source_shape], order))``.

    Boxes are local to their shard. ``shape`` is in destination axis order; destination
    axis i is source axis ``order[i]`` (None: the identity). ``casts`` are the rounding steps
    between the source dtype and the destination dtype, in order."""

    destination: int
    destination_start: tuple[int, ...]
    shape: tuple[int, ...]
    source: int
    source_start: tuple[int, ...]
    order: tuple[int, ...] | None = None
    casts: tuple[str, ...] = ()
    # A NamedTuple, not a dataclass: plans of big models hold hundreds of thousands.

    @property
    def source_shape(self) -> tuple[int, ...]:
        if self.order is None:
            return self.shape
        shape = [0] * len(self.shape)
        for i, axis in enumerate(self.order):
            shape[axis] = self.shape[i]
        return tuple(shape)

    def to_json(self) -> list:
        return [self.destination, list(self.destination_start), list(self.shape), self.source,
                list(self.source_start), None if self.order is None else list(self.order),
                list(self.casts)]

    @classmethod
    def from_json(cls, row: list) -> PlannedCopy:
        d, ds, shape, s, ss, order, casts = row
        return cls(d, tuple(ds), tuple(shape), s, tuple(ss),
                   None if order is None else tuple(order), tuple(casts))


def _copy_problem(copy: PlannedCopy, sources: Sequence[ShardDesc],
                  destinations: Sequence[ShardDesc]) -> str | None:
    """What makes a copy read from a file not one the planner could have made, or None:
    shard numbers in range, boxes of the shards' ranks inside them, a permutation, dtypes."""
    numbers = (copy.destination, copy.source, *copy.destination_start, *copy.shape,
               *copy.source_start, *(copy.order or ()))
    if not all(type(n) is int and n >= 0 for n in numbers):
        return "holds something other than non-negative integers"
    if copy.destination >= len(destinations) or copy.source >= len(sources):
        return f"names shard {copy.destination} or {copy.source}, which the plan lacks"
    destination, source = destinations[copy.destination], sources[copy.source]
    rank = len(destination.local_shape)
    if not (len(copy.destination_start) == len(copy.shape) == rank
            == len(copy.source_start) == len(source.local_shape)):
        return "has boxes of other ranks than its shards"
    if copy.order is not None and sorted(copy.order) != list(range(rank)):
        return f"has order {list(copy.order)}, not a permutation of {rank} axes"
    if not all(isinstance(dtype, str) and is_known(dtype) for dtype in copy.casts):
        return f"casts to {quote(copy.casts)}, not known dtypes"
    for start, extent, bound in (
            *zip(copy.destination_start, copy.shape, destination.local_shape),
            *zip(copy.source_start, copy.source_shape, source.local_shape)):
        if start + extent > bound:
            return "reaches past its shards"
    return None


def _scale_problem(source: int, read: ScaleRead, sources: list[ShardDesc]) -> str | None:
    """What is wrong with a quantized source's scales read from JSON (None: nothing): both
    shards exist, and there is one block (of at least one element) per axis."""
    count = len(sources)
    if not all(isinstance(n, int) and 0 <= n < count for n in (source, read.scale)):
        return f"name source {read.scale}, of {count} sources"
    if not (len(read.block) == len(sources[source].local_shape)
            and all(isinstance(b, int) and b >= 1 for b in read.block)):
        return f"have blocks {list(read.block)}, not one of at least 1 per axis"
    return None


#: one of a key's copies, as the planner memoizes it: (the shard's position among the key's
#: shards, the read's position among the key's reads, destination_start, shape,
#: source_start, order, casts)
KeyedCopy = tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...],
                  "tuple[int, ...] | None", "tuple[str, ...]"]

_new_tuple = tuple.__new__
#: a `CopyTable` block's copies
_COPIES = operator.itemgetter(1)


class CopyTable(Sequence[PlannedCopy]):
    """A plan's copies as the planner makes them: per destination key, its copies with
    shards and reads as positions (one list shared by every key laid out alike), the
    key's first destination index and the source index of each read.

    A big model's keys are planned alike by the thousand, so this is a few appends per key
    where a list would hold a PlannedCopy per copy (189k for L=61, E=256). Rows are made
    as they are read; the table compares equal to the list of them."""

    __slots__ = ("_blocks", "_ends", "_length")

    def __init__(self) -> None:
        self._blocks: list[tuple[int, Sequence[KeyedCopy], Sequence[int]]] = []
        self._ends: list[int] = []
        self._length = 0

    def add(self, first_destination: int, copies: Sequence[KeyedCopy],
            sources: Sequence[int]) -> None:
        self._blocks.append((first_destination, copies, sources))
        self._length += len(copies)

    def __len__(self) -> int:
        return self._length

    def blocks(self) -> Iterator[tuple[int, Sequence[KeyedCopy], Sequence[int]]]:
        """Per destination key: its first destination index, its copies (one sequence
        object for all keys laid out alike) and the source index of each of its reads."""
        return iter(self._blocks)

    def __iter__(self) -> Iterator[PlannedCopy]:
        for first, copies, sources in self._blocks:
            # tuple.__new__ skips the NamedTuple's Python-level __new__
            yield from [_new_tuple(PlannedCopy, (first + k, d, shape, sources[read], s, order,
                                                 casts))
                        for k, read, d, shape, s, order, casts in copies]

    @overload
    def __getitem__(self, index: int) -> PlannedCopy: ...
    @overload
    def __getitem__(self, index: slice) -> list[PlannedCopy]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError("copy index out of range")
        if len(self._ends) != len(self._blocks):
            self._ends = list(itertools.accumulate(map(len, map(_COPIES, self._blocks))))
        block = bisect.bisect_right(self._ends, index)
        first, copies, sources = self._blocks[block]
        k, read, d, shape, s, order, casts = copies[index - (self._ends[block]
                                                             - len(copies))]
        return PlannedCopy(first + k, d, shape, sources[read], s, order, casts)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (CopyTable, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"CopyTable({len(self)} copies in {len(self._blocks)} keys)"


class ScaleRead(NamedTuple):
    """A quantized source shard's second source: its values are the stored ones times the
    scale of their block, read from source shard ``scale``; ``block`` is the elements per
    block along each axis of the tensor, blocks counted from the tensor's origin (fp8
    checkpoints: one ``weight_scale_inv`` value per 128 x 128 block, the last ones
    partial)."""

    scale: int
    block: tuple[int, ...]


@dataclass
class Plan:
    sources: list[ShardDesc]
    destinations: list[ShardDesc]
    #: a CopyTable as planned, or any sequence (a list when read back from JSON)
    copies: Sequence[PlannedCopy]
    notes: list[str] = field(default_factory=list)
    #: destination shards declared with `_ -> X`: left as they are, no copy
    untouched: list[int] = field(default_factory=list)
    #: source index -> its scales, for the source shards stored quantized
    scales: dict[int, ScaleRead] = field(default_factory=dict)

    # -- queries -------------------------------------------------------------------------
    def copies_by_destination(self) -> dict[int, list[PlannedCopy]]:
        grouped: dict[int, list[PlannedCopy]] = {i: [] for i in range(len(self.destinations))}
        for c in self.copies:
            grouped[c.destination].append(c)
        return grouped

    def scale_of(self, copy: PlannedCopy) -> ScaleRead | None:
        """The scales ``copy`` dequantizes with: a copy from a quantized source into another
        dtype reads its values (stored value times scale); into the stored dtype it moves
        the stored bytes, as one quantized tensor to another (whose scales travel apart)."""
        scale = self.scales.get(copy.source)
        if scale is None or (self.sources[copy.source].dtype
                             == self.destinations[copy.destination].dtype):
            return None
        return scale

    def destination_bytes(self) -> int:
        return sum(shard.nbytes for shard in self.destinations)

    # -- serialization -------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT,
                "sources": [s.to_json() for s in self.sources],
                "destinations": [d.to_json() for d in self.destinations],
                "copies": [c.to_json() for c in self.copies],
                "untouched": list(self.untouched),
                "scales": [[source, scale, list(block)]
                           for source, (scale, block) in sorted(self.scales.items())],
                "notes": list(self.notes)}

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        """The plan of ``to_json``; a UsageError for anything else."""
        found = data.get("format") if isinstance(data, dict) else None
        if found != FORMAT:
            raise UsageError(f"not an aoa plan (format {quote(found)}, expected {FORMAT!r})")
        try:
            plan = cls([ShardDesc.from_json(s) for s in data["sources"]],
                       [ShardDesc.from_json(d) for d in data["destinations"]],
                       [PlannedCopy.from_json(c) for c in data["copies"]],
                       list(data.get("notes", [])), list(data.get("untouched", [])),
                       {source: ScaleRead(scale, tuple(block))
                        for source, scale, block in data.get("scales", [])})
        except (KeyError, TypeError, ValueError) as error:
            why = f"it lacks {error}" if isinstance(error, KeyError) else str(error)
            raise UsageError(f"not an aoa plan: {why}") from None
        for index, copy in enumerate(plan.copies):
            problem = _copy_problem(copy, plan.sources, plan.destinations)
            if problem:
                raise UsageError(f"not an aoa plan: copy {index} {problem}")
        for source, read in plan.scales.items():
            problem = _scale_problem(source, read, plan.sources)
            if problem:
                raise UsageError(f"not an aoa plan: the scales of source {source} {problem}")
        return plan

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> Plan:
        return cls.from_json(load_json(text, "plan"))

    # -- for people ----------------------------------------------------------------------
    def describe(self) -> str:
        """One block per destination shard: where each of its regions comes from."""
        out = io.StringIO()
        Printer(out).print_plan(self)
        return out.getvalue().rstrip("\n")
