"""Parse: AOA text -> IR, with a span on every node (grammar/aoa.lark, Lark LALR).

The pipeline's input is the units of text (`texts`): a `.aoa` file is one, Paddle's list
of statement strings one per item."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from lark import (
    Lark,
    Token,
    Transformer,
    UnexpectedCharacters,
    UnexpectedInput,
    UnexpectedToken,
)
from lark.exceptions import VisitError

from aoa.errors import AoaSyntaxError, UsageError, quote
from aoa.ir import FLAG_ATTRIBUTES, NAME_ATTRIBUTES, Attribute, Name, Program, Statement
from aoa.limits import MAX_NUMBER_DIGITS
from aoa.passes.context import CompileContext
from aoa.source import SourceText, Span

NAME = "parse"

_TOKEN_WORDS = {
    "ARROW": "'->'", "IDENTIFIER": "a name", "NUMBER": "a number", "STRING": "a string",
    "COMMA": "','", "EQUAL": "'='", "LSQB": "'['", "RSQB": "']'", "COLON": "':'",
    "_NEWLINE": "end of line", "$END": "end of text",
}


def _grammar_text() -> str:
    packaged = resources.files("aoa").joinpath("aoa.lark")
    if packaged.is_file():
        return packaged.read_text()
    # Running from a source checkout: the grammar lives at the top of the repository.
    return (Path(__file__).resolve().parents[3] / "grammar" / "aoa.lark").read_text()


@functools.cache
def _parser() -> Lark:
    return Lark(_grammar_text(), parser="lalr", start="program", maybe_placeholders=False,
                cache=True)


def _span(source: SourceText, first: Token, last: Token | None = None) -> Span:
    last = last or first
    return Span(source, int(first.line or 1), int(first.column or 1), int(last.end_line or 1),
                int(last.end_column or 1))


class _ToIR(Transformer):
    """Builds IR nodes; a bare `fused_ffn`-style word on the right becomes a flag attribute."""

    def __init__(self, source: SourceText) -> None:
        super().__init__()
        self.source = source

    def name(self, children):
        (token,) = children
        return Name(str(token), _span(self.source, token))

    def array_name(self, children):
        token, start, end = children[0], children[1], children[2]
        span = Span(self.source, token.line, token.column, token.end_line, end.end_column + 1)
        return Name(str(token), span, array=(self._int(start), self._int(end)))

    def number(self, children):
        (token,) = children
        return (self._int(token), token)

    def _int(self, token: Token) -> int:
        if len(token) > MAX_NUMBER_DIGITS:
            raise AoaSyntaxError(
                f"the number {quote(str(token))} has {len(token)} digits, more than "
                f"{MAX_NUMBER_DIGITS}", _span(self.source, token),
                hint="Axes, head counts and ranges are small numbers.")
        return int(token)

    def string(self, children):
        (token,) = children
        return (str(token)[1:-1], token)

    def word(self, children):
        (token,) = children
        return (str(token), token)

    def attribute(self, children):
        key, (value, value_token) = children
        if value_token.type == "IDENTIFIER" and str(key) not in NAME_ATTRIBUTES:
            raise AoaSyntaxError(
                f"expected a number or a string after '{key}=', got {quote(str(value_token))}",
                _span(self.source, value_token),
                hint="Only " + ", ".join(sorted(NAME_ATTRIBUTES)) + " takes a key as its "
                     "value; quote a string: `dtype='float32'`.")
        return Attribute(str(key), value, _span(self.source, key, value_token))

    def left(self, children):
        return tuple(children)

    def statement(self, children):
        left, arrow, *items = children
        right: list[Name] = []
        attributes: list[Attribute] = []
        for item in items:
            if isinstance(item, Attribute):
                attributes.append(item)
            elif item.text in FLAG_ATTRIBUTES:
                attributes.append(Attribute(item.text, None, item.span))
            elif attributes:
                raise AoaSyntaxError(
                    f"'{item.text}' follows the attributes of the statement",
                    item.span, hint="Names go before the attributes: `a -> b, c, axis=1`.")
            else:
                right.append(item)
        first = left[0].span
        last = (attributes[-1] if attributes and (not right or attributes[-1].span.end_column
                > right[-1].span.end_column) else (right[-1] if right else arrow))
        last_span = last.span if not isinstance(last, Token) else _span(self.source, last)
        span = Span(self.source, first.line, first.column, last_span.end_line,
                    last_span.end_column)
        return Statement(left, tuple(right), tuple(attributes), span)

    def program(self, children):
        return [child for child in children if isinstance(child, Statement)]


def _syntax_error(source: SourceText, error: UnexpectedInput) -> AoaSyntaxError:
    line, column = int(error.line or 1), int(error.column or 1)
    if isinstance(error, UnexpectedCharacters):
        position = int(error.pos_in_stream or 0)
        char = source.text[position]
        span = Span(source, line, column, line, column + 1)
        if char == "-" and source.text[position + 1:position + 2].isdigit():
            return AoaSyntaxError("negative numbers are not part of AOA", span,
                                  hint="AOA has no negative axes; write the axis counted "
                                       "from 0 (the last axis of a 2-D tensor is axis=1).")
        return AoaSyntaxError(f"unexpected character {char!r}", span,
                              hint="Names are letters, digits, '.', '_', '$' and '*', and "
                                   "start with a letter or '_'.")
    assert isinstance(error, UnexpectedToken)
    token = error.token
    expected = sorted({_TOKEN_WORDS.get(t, t) for t in error.expected if not t.startswith("__")})
    if token.type == "$END":
        lines = source.text.splitlines() or [""]
        line, column = len(lines), len(lines[-1]) + 1
        got = "end of text"
    elif token.type == "_NEWLINE":
        got = "end of line"
    else:
        got = repr(str(token))
    span = Span(source, line, column, line, column + max(1, len(str(token).rstrip("\r\n"))))
    missing = _missing_comma(source, line, column)
    if missing is not None:
        return missing
    hint = "A statement is `source, ... -> destination, ..., attribute=value` on one line."
    if token.type == "NUMBER":
        hint = "A name cannot start with a digit; such a tensor can only be carried unchanged."
    return AoaSyntaxError(f"expected {' or '.join(expected)}, got {got}", span, hint=hint)


_ATTRIBUTE_THEN_WORD = re.compile(
    r"""([A-Za-z_][\w.$*^]*\s*=\s*(?:\d+|"[^"]*"|'[^']*'))[ \t]+([A-Za-z_][\w.$*^]*)\s*,""")


def _missing_comma(source: SourceText, line: int, column: int) -> AoaSyntaxError | None:
    """`axis=0 fused_qkv_old, ...`: a word glued to an attribute, on a line that fails later.

    (`axis=1p -> q` glued without a space stays two statements, as in Paddle.)"""
    text = source.line(line)
    for match in _ATTRIBUTE_THEN_WORD.finditer(text):
        if match.start(2) < column:
            start = match.start(2) + 1
            return AoaSyntaxError(
                f"missing ',' between '{match.group(1)}' and '{match.group(2)}'",
                Span(source, line, start, line, start + len(match.group(2))),
                hint=f"Separate the attributes with a comma: `{match.group(1)}, "
                     f"{match.group(2)}`.")
    return None


def parse_source(source: SourceText) -> list[Statement]:
    """Statements of one unit of text, in order."""
    try:
        tree = _parser().parse(source.text)
    except UnexpectedInput as error:
        raise _syntax_error(source, error) from None
    try:
        return _ToIR(source).transform(tree)
    except VisitError as error:
        raise error.orig_exc from None


def texts(statements: str | Sequence[str], *, file: str | None = None
          ) -> tuple[SourceText, ...]:
    """The units of a program: one text (a `.aoa` file), or Paddle's list of statement
    strings (each item may hold several statements, or none)."""
    if not isinstance(statements, str) and not (
            isinstance(statements, Sequence)
            and all(isinstance(text, str) for text in statements)):
        raise UsageError(f"statements must be a text or a list of texts, not "
                         f"{quote(statements)}")
    if isinstance(statements, str):
        return (SourceText(file or "<aoa>", statements),)
    return tuple(SourceText(f"{file or '<statement'} {i}>" if file is None else f"{file}[{i}]",
                            text) for i, text in enumerate(statements))


def run(units: Sequence[SourceText], ctx: CompileContext) -> Program:
    result: list[Statement] = []
    for unit in units:
        result.extend(parse_source(unit))
    return Program(tuple(result))
