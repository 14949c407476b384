"""What every pass may consult: the shard information, the direction, and a place for notes.

Results one pass hands to a later one travel in the IR, typed (`Program.shared`,
`ChainedProgram.chains`, `SymbolicTensors`), not here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aoa.errors import AoaError
from aoa.layout import ShardDesc, check_tiling, model_state_keys, sharded_alike
from aoa.source import Span

if TYPE_CHECKING:
    from aoa.record import FusedRecord


@dataclass(frozen=True)
class Note:
    """Something surprising but valid (spec 0.1): `aoa check` prints these."""

    message: str
    span: Span | None = None

    def render(self) -> str:
        head = f"{self.span.location()}: " if self.span else ""
        lines = [f"{head}note: {self.message}"]
        if self.span:
            lines += self.span.caret_lines()
        return "\n".join(lines)


class Shardings:
    """Numbers for the ways keys are sharded: shards' boxes and dtypes, in listed order.
    Keys with equal numbers are sharded alike, so the passes that treat alike keys alike
    (sharing template instances, planning) compare numbers; one numbering per compile,
    for the source and the destination alike."""

    def __init__(self) -> None:
        self._numbers: dict[tuple, int] = {}

    def number(self, shards: Sequence[ShardDesc]) -> int:
        numbers = self._numbers
        if len(shards) == 1:
            (s,) = shards
            return numbers.setdefault((s.global_offset, s.local_shape, s.global_shape, s.dtype),
                                      len(numbers))
        return numbers.setdefault(tuple([(s.global_offset, s.local_shape, s.global_shape,
                                          s.dtype) for s in shards]), len(numbers))

    def of_keys(self, info: Mapping[str, Sequence[ShardDesc]] | None) -> dict[str, int]:
        """The number of each key's shards (`number`, inline: a model has 100k keys); where
        a reader knows which keys are sharded alike, `number` of one key of each way.

        A key of one shard (most keys) is numbered by that shard's row alone, not by a
        tuple of one row: a row ends with a dtype (a text or None), a tuple of several
        rows with a row, so the two never stand for each other."""
        known = sharded_alike(info)
        if known is not None:
            keys, ways, shards_of_way = known
            return dict(zip(keys, map(list(map(self.number, shards_of_way)).__getitem__,
                                      ways)))
        numbers = self._numbers
        setdefault = numbers.setdefault
        result = {}
        for key, shards in (info or {}).items():
            if len(shards) == 1:
                s = shards[0]
                result[key] = setdefault((s.global_offset, s.local_shape, s.global_shape,
                                          s.dtype), len(numbers))
            else:
                result[key] = setdefault(tuple([(s.global_offset, s.local_shape,
                                                 s.global_shape, s.dtype) for s in shards]),
                                         len(numbers))
        return result


@dataclass
class CompileContext:
    """``strict``: refuse what Paddle runs but a person almost surely did not mean (a
    statement that expands to nothing, a source key passed on unmentioned while others are
    renamed, a fused_qkv group split over ranks, a tensor ``fused`` records as fused
    re-laid without its macro); without it they are notes. ``fused``: what the source's
    record says is stored fused (None: no record)."""

    source: dict[str, list[ShardDesc]]
    destination: dict[str, list[ShardDesc]] | None
    reverse: bool = False
    notes: list[Note] = field(default_factory=list)
    strict: bool = False
    fused: FusedRecord | None = None

    def __post_init__(self) -> None:
        self.source_keys = model_state_keys(self.source)
        self.destination_keys = model_state_keys(self.destination)
        self.shardings = Shardings()
        self.source_shardings = self.shardings.of_keys(self.source)
        self.destination_shardings = self.shardings.of_keys(self.destination)
        checked: set[int] = set()
        for key, number in self.source_shardings.items():
            if number not in checked:  # keys sharded alike are checked once
                checked.add(number)
                shards = self.source[key]
                # one shard of the whole tensor tiles it (the usual for a source read
                # whole): its box is inside the shape, as every ShardDesc's is
                if len(shards) != 1 or shards[0].local_shape != shards[0].global_shape:
                    check_tiling(key, shards)

    def note(self, message: str, span: Span | None = None) -> None:
        self.notes.append(Note(message, span))

    def mistake(self, error: AoaError) -> None:
        """A likely mistake: raised when strict, else a note of its message and place."""
        if self.strict:
            raise error
        self.note(error.message, error.span)
