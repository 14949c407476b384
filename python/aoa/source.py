"""Where a piece of AOA text came from, and how to point at it in a message."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceText:
    """One unit of AOA text: a `.aoa` file, or one statement string of a list."""

    name: str
    text: str

    def line(self, number: int) -> str:
        lines = self.text.splitlines()
        return lines[number - 1] if 0 < number <= len(lines) else ""


@dataclass(frozen=True)
class Span:
    """A region of a SourceText: 1-based line and column, end exclusive."""

    source: SourceText
    line: int
    column: int
    end_line: int
    end_column: int

    def location(self) -> str:
        return f"{self.source.name}:{self.line}:{self.column}"

    def caret_lines(self) -> list[str]:
        """The source line and a caret run under the spanned characters."""
        text = self.source.line(self.line).replace("\t", " ")
        end = self.end_column if self.end_line == self.line else len(text) + 1
        width = max(1, end - self.column)
        return [f"    {text}", "    " + " " * (self.column - 1) + "^" * width]

    def __repr__(self) -> str:
        return f"Span({self.location()})"
