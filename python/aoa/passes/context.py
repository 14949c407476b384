"""What every pass may consult: the shard information, the direction, and a place for notes.

Results one pass hands to a later one travel in the IR, typed (`Program.shared`,
`ChainedProgram.chains`, `SymbolicTensors`), not here."""

from __future__ import annotations

from dataclasses import dataclass, field

from aoa.layout import ShardDesc, layout_ids, model_state_keys
from aoa.source import Span


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


@dataclass
class CompileContext:
    source: dict[str, list[ShardDesc]]
    destination: dict[str, list[ShardDesc]] | None
    reverse: bool = False
    notes: list[Note] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.source_keys = model_state_keys(self.source)
        self.destination_keys = model_state_keys(self.destination)
        self.source_layouts = layout_ids(self.source)
        self.destination_layouts = layout_ids(self.destination)

    def note(self, message: str, span: Span | None = None) -> None:
        self.notes.append(Note(message, span))
