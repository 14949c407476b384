"""Parse: AOA text -> IR, with a span on every node (grammar/aoa.lark, Lark LALR).

The pipeline's input is the units of text (`texts`): a `.aoa` file is one, Paddle's list
of statement strings one per item."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from aoa.errors import AoaSyntaxError, UsageError, quote
from aoa.ir import (
    FLAG_ATTRIBUTES,
    NAME_ATTRIBUTES,
    Attribute,
    Name,
    Program,
    Statement,
    make_attribute,
    make_name,
    make_statement,
)
from aoa.limits import MAX_NUMBER_DIGITS
from aoa.passes.context import CompileContext
from aoa.source import SourceText, Span, make_source_text, make_span

if TYPE_CHECKING:  # Lark is imported where a text is parsed by it: the fast path takes most
    from lark import Lark, Token, Transformer, UnexpectedInput

NAME = "parse"

_TOKEN_WORDS = {
    "ARROW": "'->'", "IDENTIFIER": "a name", "NUMBER": "a number", "STRING": "a string",
    "COMMA": "','", "EQUAL": "'='", "LSQB": "'['", "RSQB": "']'", "COLON": "':'",
    "_NEWLINE": "end of line", "$END": "end of text",
}


def _grammar_text() -> str:
    from importlib import resources  # (once, for a statement the one-line reader leaves)

    packaged = resources.files("aoa").joinpath("aoa.lark")
    if packaged.is_file():
        return packaged.read_text()
    # Running from a source checkout: the grammar lives at the top of the repository.
    return (Path(__file__).resolve().parents[3] / "grammar" / "aoa.lark").read_text()


@functools.cache
def _parser() -> Lark:
    from lark import Lark

    return Lark(_grammar_text(), parser="lalr", start="program", maybe_placeholders=False,
                cache=True)


def _span(source: SourceText, first: Token, last: Token | None = None) -> Span:
    last = last or first
    return Span(source, int(first.line or 1), int(first.column or 1), int(last.end_line or 1),
                int(last.end_column or 1))


@functools.cache
def _to_ir() -> Callable[[SourceText], Transformer]:
    """`_ToIR` as a Lark Transformer (made when Lark's path is first taken)."""
    from lark import Transformer

    return type("_ToIR", (_ToIR, Transformer), {})


class _ToIR:
    """Builds IR nodes; a bare `fused_ffn`-style word on the right becomes a flag attribute.
    (Lark's callbacks, mixed into its Transformer by `_to_ir`.)"""

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
        return _statement(self.source, left, items, arrow)

    def program(self, children):
        return [child for child in children if isinstance(child, Statement)]


def _syntax_error(source: SourceText, error: UnexpectedInput) -> AoaSyntaxError:
    from lark import UnexpectedCharacters, UnexpectedToken

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


#: the grammar's terminals (grammar/aoa.lark), none a prefix of another's match, so one
#: alternation splits any text Lark parses into Lark's own tokens
_TOKENS = re.compile(
    r"""(?P<ws>[ \t]+)|(?P<comment>#[^\n]*)|(?P<nl>[\r\n]+)|(?P<arrow>->)|(?P<num>\d+)"""
    r"""|(?P<str>"[^"\n]*"|'[^'\n]*')|(?P<id>[A-Za-z_][A-Za-z0-9.$_*^]*)|(?P<p>[,=\[\]:])""")
#: a token of the fast path: (kind, text, line, column), Lark's line and column
_Tok = tuple[str, str, int, int]


#: an identifier's run possessive: what follows one in these patterns (blanks, `,`, `->`,
#: `=`, the end) never starts with its characters, so giving some back cannot help a match
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9.$_*^]*+"
_NAMES = rf"{_IDENTIFIER}(?:[ \t]*,[ \t]*{_IDENTIFIER})*"
_VALUE = rf"""(\d+)|"([^"\n]*)"|'([^'\n]*)'|({_IDENTIFIER})"""
#: one statement alone on its line, its names then `key=value` attributes: what Paddle's
#: lists of statement strings hold, one string each
_ONE_LINE = re.compile(
    rf"[ \t]*({_NAMES})[ \t]*->[ \t]*({_NAMES})"
    rf"((?:[ \t]*,[ \t]*{_IDENTIFIER}[ \t]*=[ \t]*(?:{_VALUE.replace('(', '(?:')}))*)"
    r"[ \t]*")
_NAME = re.compile(_IDENTIFIER)
_ATTRIBUTE = re.compile(rf"({_IDENTIFIER})[ \t]*=[ \t]*(?:{_VALUE})")


def _one_line_parse(source: SourceText) -> list[Statement] | None:
    """`_fast_parse` of a text that is one statement on one line, by one match (None: the
    text is not such a statement)."""
    found = _ONE_LINE.fullmatch(source.text)
    if found is None:
        return None
    left = tuple(_names(source, found, 1))
    right = _names(source, found, 2)
    attributes = []
    if (right[0].text in FLAG_ATTRIBUTES if len(right) == 1
            else not FLAG_ATTRIBUTES.isdisjoint([name.text for name in right])):
        while right and right[-1].text in FLAG_ATTRIBUTES:
            flag = right.pop()
            attributes.append(make_attribute(flag.text, None, flag.span))
        if not right or any(name.text in FLAG_ATTRIBUTES for name in right):
            return None  # a name after the attributes, or none before: Lark's path says so
        attributes.reverse()
    end = found.end(2)
    if found.start(3) != found.end(3):
        end = found.end(3)
        for attribute in _ATTRIBUTE.finditer(source.text, found.start(3), end):
            key, number, double, single, word = attribute.groups()
            held: int | str
            if number is not None:
                if len(number) > MAX_NUMBER_DIGITS:
                    return None
                held = int(number)
            elif word is not None:
                if key not in NAME_ATTRIBUTES:
                    return None
                held = word
            else:
                held = double if double is not None else single
            attributes.append(make_attribute(key, held, make_span(
                source, 1, attribute.start() + 1, 1, attribute.end() + 1)))
    return [make_statement(left, tuple(right), tuple(attributes),
                           make_span(source, 1, found.start(1) + 1, 1, end + 1))]


def _names(source: SourceText, found: re.Match, group: int) -> list[Name]:
    """The names of a group of `_ONE_LINE`, with their spans."""
    start, end = found.span(group)
    text = found.group(group)
    if "," not in text:
        return [make_name(text, make_span(source, 1, start + 1, 1, end + 1))]
    if " " in text or "\t" in text:
        return [make_name(name.group(), make_span(source, 1, name.start() + 1, 1,
                                                  name.end() + 1))
                for name in _NAME.finditer(source.text, start, end)]
    # names and commas alone (Paddle's lists join them so): each name ends at its comma
    names = []
    column = start + 1
    for word in text.split(","):
        end_column = column + len(word)
        names.append(make_name(word, make_span(source, 1, column, 1, end_column)))
        column = end_column + 1
    return names


def _fast_parse(source: SourceText) -> list[Statement] | None:
    """The statements of ``source`` as Lark and `_ToIR` make them, without Lark, or None
    for a text the fast path does not take (any error, anything unusual): `parse_source`
    then parses it with Lark, which gives the same result or the same error."""
    one_line = _one_line_parse(source)
    if one_line is not None:
        return one_line
    text = source.text
    tokens: list[_Tok] = []
    pos, line, line_start, size = 0, 1, 0, len(text)
    match = _TOKENS.match
    while pos < size:
        found = match(text, pos)
        if found is None:
            return None
        kind, end = found.lastgroup, found.end()
        if kind == "nl":
            newlines = text.count("\n", pos, end)
            if newlines:
                line += newlines
                line_start = text.rindex("\n", pos, end) + 1
            tokens.append(("nl", "", line, 0))
        elif kind != "ws" and kind != "comment":
            tokens.append((kind, found.group(), line, pos - line_start + 1))  # type: ignore
        pos = end
    tokens.append(("end", "", line, 0))
    statements: list[Statement] = []
    at = 0

    def name() -> Name | None:
        nonlocal at
        kind, word, line, column = tokens[at]
        if kind != "id":
            return None
        at += 1
        if tokens[at][1] != "[":
            return Name(word, Span(source, line, column, line, column + len(word)))
        if at + 5 > len(tokens):
            return None
        opened, first, colon, last, closed = tokens[at:at + 5]
        if (first[0] != "num" or last[0] != "num" or colon[1] != ":" or closed[1] != "]"
                or opened[0] != "p" or colon[0] != "p" or closed[0] != "p"
                or len(first[1]) > MAX_NUMBER_DIGITS or len(last[1]) > MAX_NUMBER_DIGITS):
            return None
        at += 5
        return Name(word, Span(source, line, column, last[2], last[3] + len(last[1]) + 1),
                    array=(int(first[1]), int(last[1])))

    while True:
        kind = tokens[at][0]
        if kind == "end":
            return statements
        if kind == "nl":
            at += 1
            continue
        left = [name()]
        while left[-1] is not None and tokens[at][:2] == ("p", ","):
            at += 1
            left.append(name())
        if left[-1] is None or tokens[at][0] != "arrow":
            return None
        at += 1
        items: list[Name | Attribute | None] = [name()]
        while items[-1] is not None and tokens[at][:2] == ("p", ","):
            at += 1
            key = tokens[at]
            if key[0] == "id" and tokens[at + 1][:2] == ("p", "="):
                value = tokens[at + 2]
                at += 3
                kind = value[0]
                if kind == "num" and len(value[1]) <= MAX_NUMBER_DIGITS:
                    held: int | str = int(value[1])
                elif kind == "str":
                    held = value[1][1:-1]
                elif kind == "id" and key[1] in NAME_ATTRIBUTES:
                    held = value[1]
                else:
                    return None
                items.append(Attribute(key[1], held, Span(source, key[2], key[3], value[2],
                                                          value[3] + len(value[1]))))
            else:
                items.append(name())
        if items[-1] is None or tokens[at][0] not in ("nl", "id", "end"):
            return None
        seen_attribute = False
        for item in items:
            if isinstance(item, Attribute) or item.text in FLAG_ATTRIBUTES:  # type: ignore
                seen_attribute = True
            elif seen_attribute:
                return None  # a name after the attributes: Lark's path says so
        statements.append(_statement(source, tuple(left), items, None))  # type: ignore


def _statement(source: SourceText, left: tuple[Name, ...], items: Sequence[Name | Attribute],
               arrow: Token | None) -> Statement:
    """A statement of its transformed parts (``arrow`` None only where the right side
    has an item, as the grammar has it)."""
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
    last = (attributes[-1] if attributes and (
        not right or attributes[-1].span.end_column  # type: ignore[union-attr]
        > right[-1].span.end_column)  # type: ignore[union-attr]
        else (right[-1] if right else arrow))
    assert last is not None
    last_span = last.span if isinstance(last, (Name, Attribute)) else _span(source, last)
    span = Span(source, first.line, first.column, last_span.end_line,  # type: ignore
                last_span.end_column)  # type: ignore[union-attr]
    return Statement(left, tuple(right), tuple(attributes), span)


def parse_source(source: SourceText) -> list[Statement]:
    """Statements of one unit of text, in order."""
    fast = _fast_parse(source)
    if fast is not None:
        return fast
    return _lark_parse(source)


def _lark_parse(source: SourceText) -> list[Statement]:
    """`parse_source` by Lark: every text, and every error's message."""
    from lark import UnexpectedInput
    from lark.exceptions import VisitError

    try:
        tree = _parser().parse(source.text)
    except UnexpectedInput as error:
        raise _syntax_error(source, error) from None
    try:
        return _to_ir()(source).transform(tree)
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
    if file is None:
        return tuple([make_source_text(f"<statement {i}>", text)
                      for i, text in enumerate(statements)])
    return tuple([make_source_text(f"{file}[{i}]", text) for i, text in enumerate(statements)])


def run(units: Sequence[SourceText], ctx: CompileContext) -> Program:
    result: list[Statement] = []
    for unit in units:
        result.extend(parse_source(unit))
    return Program(tuple(result))
