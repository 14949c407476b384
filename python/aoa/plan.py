"""The Plan: plain data saying, per destination shard, which source bytes to copy where.

It is what `aoa compile` writes, what `aoa explain` describes, and all that the executor
reads: shard descriptions on both sides and a list of copies with boxes, an axis order
(permutation) and rounding steps. `kernel_copies()` lowers it to byte offsets and strides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from math import prod
from typing import NamedTuple

from aoa.dtypes import itemsize
from aoa.layout import ShardDesc
from aoa.runtime.copies import Copy, c_strides

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


@dataclass
class Plan:
    sources: list[ShardDesc]
    destinations: list[ShardDesc]
    copies: list[PlannedCopy]
    notes: list[str] = field(default_factory=list)
    #: destination shards declared with `_ -> X`: left as they are, no copy
    untouched: list[int] = field(default_factory=list)

    # -- execution -----------------------------------------------------------------------
    def kernel_copies(self, copies: list[PlannedCopy] | None = None) -> list[Copy]:
        """Byte offsets and strides for C-contiguous shard buffers, in plan order."""
        result = []
        for c in self.copies if copies is None else copies:
            src, dst = self.sources[c.source], self.destinations[c.destination]
            src_dtype, dst_dtype = src.dtype or "float32", dst.dtype or "float32"
            src_strides = c_strides(src.local_shape, itemsize(src_dtype))
            dst_strides = c_strides(dst.local_shape, itemsize(dst_dtype))
            src_offset = sum(a * b for a, b in zip(c.source_start, src_strides))
            dst_offset = sum(a * b for a, b in zip(c.destination_start, dst_strides))
            if c.order is not None:
                src_strides = tuple(src_strides[a] for a in c.order)
            result.append(Copy(c.source, src_offset, src_strides, c.destination, dst_offset,
                               dst_strides, c.shape, src_dtype, dst_dtype, c.casts))
        return result

    def copies_by_destination(self) -> dict[int, list[PlannedCopy]]:
        grouped: dict[int, list[PlannedCopy]] = {i: [] for i in range(len(self.destinations))}
        for c in self.copies:
            grouped[c.destination].append(c)
        return grouped

    def shard_bytes(self, index: int) -> int:
        shard = self.destinations[index]
        return prod(shard.local_shape) * itemsize(shard.dtype or "float32")

    def destination_bytes(self) -> int:
        return sum(self.shard_bytes(i) for i in range(len(self.destinations)))

    # -- serialization -------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT,
                "sources": [s.to_json() for s in self.sources],
                "destinations": [d.to_json() for d in self.destinations],
                "copies": [c.to_json() for c in self.copies],
                "untouched": list(self.untouched),
                "notes": list(self.notes)}

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        if data.get("format") != FORMAT:
            raise ValueError(f"not an aoa plan (format {data.get('format')!r}, "
                             f"expected {FORMAT!r})")
        return cls([ShardDesc.from_json(s) for s in data["sources"]],
                   [ShardDesc.from_json(d) for d in data["destinations"]],
                   [PlannedCopy.from_json(c) for c in data["copies"]],
                   list(data.get("notes", [])), list(data.get("untouched", [])))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> Plan:
        return cls.from_json(json.loads(text))

    # -- for people ----------------------------------------------------------------------
    def describe(self) -> str:
        """One block per destination shard: where each of its regions comes from."""
        lines = [f"plan: {len(self.sources)} source shards -> {len(self.destinations)} "
                 f"destination shards, {len(self.copies)} copies, "
                 f"{self.destination_bytes():,} bytes"]
        grouped = self.copies_by_destination()
        for index, dst in enumerate(self.destinations):
            lines.append(f"{_box_text(dst)}  {dst.dtype or '-'}")
            if index in self.untouched:
                lines.append("    (left as it is: declared with `_ -> key`)")
            for c in grouped[index]:
                src = self.sources[c.source]
                region = ", ".join(f"{a}:{a + n}" for a, n in zip(c.destination_start, c.shape))
                source_region = ", ".join(f"{o + a}:{o + a + n}" for o, a, n in
                                          zip(src.global_offset, c.source_start, c.source_shape))
                steps = []
                if c.order is not None:
                    steps.append(f"permute {list(c.order)}")
                steps += [f"round to {d}" for d in c.casts]
                if (src.dtype or "float32") != (dst.dtype or "float32"):
                    steps.append(f"cast {src.dtype} -> {dst.dtype}")
                extra = f"  ({'; '.join(steps)})" if steps else ""
                lines.append(f"    [{region}] <- {src.key}[{source_region}]{extra}")
        return "\n".join(lines)


def _box_text(shard: ShardDesc) -> str:
    region = ", ".join(f"{o}:{o + n}" for o, n in zip(shard.global_offset, shard.local_shape))
    return f"{shard.key}[{region}] of {list(shard.global_shape)}"
