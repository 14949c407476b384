"""The error hierarchy: every failure aoa reports is an AoaError, printed like a compiler's.

    mapping.aoa:3:1: error: 'zz' is neither a source key nor assigned before
        zz -> b
        ^^
    note: expanded from ...
    hint: one sentence on how to fix it
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any

from aoa.source import Span


class _Quote(reprlib.Repr):
    """reprlib's short repr, also of integers too long to print (Python refuses past 4300
    digits)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxlist, self.maxdict = 3, 6, 4
        self.maxstring = self.maxother = self.maxlong = 60

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 200:
            digits = int(x.bit_length() * 0.30103)  # log10(2)
            return f"{'-' if x < 0 else ''}<an integer of about {digits} digits>"
        return super().repr_int(x, level)


_QUOTE = _Quote()


def quote(value: Any) -> str:
    """A value from the input, quoted for a message: short, whatever its size or depth."""
    return _QUOTE.repr(value)


class AoaError(Exception):
    """Base class. ``span`` points at the token at fault; ``expanded_from`` lists, for a
    statement a macro made, (macro, statement text) from the written statement inwards."""

    kind = "error"

    def __init__(
        self,
        message: str,
        span: Span | None = None,
        *,
        hint: str | None = None,
        expanded_from: Sequence[tuple[str, str]] = (),
        related: Sequence[tuple[str, Span | None]] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.span = span
        self.hint = hint
        self.expanded_from = tuple(expanded_from)
        self.related = tuple(related)

    def render(self) -> str:
        """The full multi-line report: location, source line, caret, origins, hint."""
        head = f"{self.span.location()}: " if self.span else ""
        lines = [f"{head}{self.kind}: {self.message}"]
        if self.span:
            lines += self.span.caret_lines()
        if self.expanded_from:
            lines.append("  in a statement expanded from the one above:")
            lines += [f"    by {macro}: {_shorten(text)}" for macro, text in self.expanded_from]
        for note, related_span in self.related:
            if related_span is None:
                lines.append(f"  note: {note}")
                continue
            lines.append(f"  {related_span.location()}: note: {note}")
            lines += related_span.caret_lines()
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _shorten(text: str, width: int = 160) -> str:
    """A statement a macro made, cut to one screen line (`p[0:4096]` makes 4096 names)."""
    return text if len(text) <= width else text[:width - 5] + " ..."


class AoaSyntaxError(AoaError):
    """Text that the grammar does not accept."""


class MacroError(AoaError):
    """A macro ($LAYER_ID, *, [a:b], ^T, fused_*) that cannot be expanded as written."""


class ChainError(AoaError):
    """A temporary whose source or destination cannot be traced: a cycle or an ambiguity."""


class ShapeError(AoaError):
    """A statement whose tensors do not fit: unknown names, non-divisible splits, bad axes."""


class ValidationError(AoaError):
    """A program that would produce wrong data: refused before any byte moves (spec 0.3)."""


class PlanError(AoaError):
    """Shard descriptions that the plan cannot be built from (missing or overlapping shards)."""


class StorageError(AoaError):
    """A checkpoint file or folder that cannot be read or written as claimed."""


class ExecutionError(AoaError):
    """A copy that the kernel refused (a region out of the bounds of its buffer)."""


class UsageError(AoaError):
    """Wrong arguments to the API or the command line."""
