"""Where a piece of AOA text came from, and how to point at it in a message."""

from __future__ import annotations

from dataclasses import dataclass

from aoa.frozen import fields_twin


@dataclass(frozen=True, slots=True)
class SourceText:
    """One unit of AOA text: a `.aoa` file, or one statement string of a list."""

    name: str
    text: str

    def line(self, number: int) -> str:
        lines = self.text.splitlines()
        return lines[number - 1] if 0 < number <= len(lines) else ""


#: Characters of a source line an error shows, and how many of them before the caret.
_SHOWN_COLUMNS, _CONTEXT_COLUMNS = 120, 40


@dataclass(frozen=True, slots=True)
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
        """The source line and a caret run under the spanned characters; of a line longer
        than a screen, the part around the span, cut short with '...'."""
        text = self.source.line(self.line).replace("\t", " ")
        end = self.end_column if self.end_line == self.line else len(text) + 1
        start, width = self.column - 1, max(1, end - self.column)
        if len(text) > _SHOWN_COLUMNS:
            first = max(0, start - _CONTEXT_COLUMNS)
            last = min(len(text), first + _SHOWN_COLUMNS)
            width = max(1, min(width, last - start))
            text = ("..." if first else "") + text[first:last] + (
                "..." if last < len(text) else "")
            start -= first - (3 if first else 0)
        return [f"    {text}", "    " + " " * start + "^" * width]

    def __repr__(self) -> str:
        return f"Span({self.location()})"


_SpanFields = fields_twin(Span)
_SourceTextFields = fields_twin(SourceText)
_new_object = object.__new__


def make_span(source: SourceText, line: int, column: int, end_line: int,
              end_column: int) -> Span:
    """``Span(...)`` by plain stores (`aoa.frozen`): every name and statement parsed gets
    one, the generated constructor sets the five fields a call each."""
    span = _new_object(_SpanFields)
    span.source, span.line, span.column = source, line, column
    span.end_line, span.end_column = end_line, end_column
    span.__class__ = Span
    return span


def make_source_text(name: str, text: str) -> SourceText:
    """``SourceText(name, text)`` by plain stores: one per statement string of a list."""
    source = _new_object(_SourceTextFields)
    source.name, source.text = name, text
    source.__class__ = SourceText
    return source
