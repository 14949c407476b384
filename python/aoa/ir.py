"""The IR: frozen statements whose spans do not take part in equality.

Tests compare structure; errors still point at line and column. A statement made by a macro
records the statement it came from and the macro's name, so errors can walk back to the
text the user wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from aoa.frozen import fields_twin
from aoa.source import Span

#: Attribute keys that name a macro rather than a tensor (written bare: `a -> b, fused_ffn`).
FLAG_ATTRIBUTES = frozenset({"fused_ffn", "fused_qkv_old", "fused_qkv", "fused_in_proj"})
#: The fused macros that lay their fused tensor out in pieces of one size per shard (the
#: grouped layout of `fused_qkv` is the same for any shard count; `fused_in_proj`'s parts
#: may differ in size).
PER_SHARD_FLAGS = frozenset({"fused_ffn", "fused_qkv_old"})
#: The fused macros whose fused tensor is laid out by its shard count: stored so, it keeps
#: its meaning at another shard count only when its macro lays it out again.
SHARD_COUNT_FLAGS = PER_SHARD_FLAGS | {"fused_in_proj"}
#: Attributes whose value is a key written bare (PaddleFormers' `tp_probe_key=model.x.w`).
NAME_ATTRIBUTES = frozenset({"tp_probe_key"})

#: Paddle's GLOBAL_ATTRIBUTE_KEYWORDS. In aoa a tensor may be named so; its templates treat
#: such a name as Paddle's do (expand_macros, quirk Q21).
ATTRIBUTE_KEYWORDS = frozenset({
    "axis", "fused_ffn", "fused_qkv_old", "num_heads", "num_key_value_groups", "permute",
    "dtype", "fused_qkv", "src_dtype", "dst_dtype",
})

#: The name that means "nothing": `X -> _` deletes, `_ -> Y` adds an empty destination.
NOTHING = "_"


# The IR classes below are frozen dataclasses with an __init__ of their own, which sets the
# slots through their descriptors: the generated one goes through object.__setattr__ field
# by field (40% slower), and every compile makes these by the thousand, a big one by the
# hundred thousand.


@dataclass(frozen=True, slots=True, init=False)
class Name:
    """A tensor name as written. ``array`` holds `[a:b]` of `NAME[a:b]` until expanded."""

    text: str
    span: Span | None = field(default=None, compare=False, repr=False)
    array: tuple[int, int] | None = None

    def __init__(self, text: str, span: Span | None = None,
                 array: tuple[int, int] | None = None) -> None:
        _set_name_text(self, text)
        _set_name_span(self, span)
        _set_name_array(self, array)

    def __str__(self) -> str:
        return self.text if self.array is None else f"{self.text}[{self.array[0]}:{self.array[1]}]"

    @property
    def transposed(self) -> bool:
        return self.text.endswith("^T")

    @property
    def base(self) -> str:
        """The name without a trailing `^T`."""
        return self.text[:-2] if self.text.endswith("^T") else self.text


@dataclass(frozen=True, slots=True, init=False)
class Attribute:
    """`key=value`; ``value`` is None for a bare flag such as `fused_ffn`."""

    key: str
    value: int | str | None
    span: Span | None = field(default=None, compare=False, repr=False)

    def __init__(self, key: str, value: int | str | None, span: Span | None = None) -> None:
        _set_attribute_key(self, key)
        _set_attribute_value(self, value)
        _set_attribute_span(self, span)


@dataclass(frozen=True, slots=True, init=False)
class Origin:
    """Which statement a macro-made statement came from, and through which macro."""

    macro: str
    statement: Statement

    def __init__(self, macro: str, statement: Statement) -> None:
        _set_origin_macro(self, macro)
        _set_origin_statement(self, statement)


@dataclass(frozen=True, slots=True, init=False)
class Statement:
    left: tuple[Name, ...]
    right: tuple[Name, ...]
    attributes: tuple[Attribute, ...] = ()
    span: Span | None = field(default=None, compare=False, repr=False)
    origin: Origin | None = field(default=None, compare=False, repr=False)

    def __init__(self, left: tuple[Name, ...], right: tuple[Name, ...],
                 attributes: tuple[Attribute, ...] = (), span: Span | None = None,
                 origin: Origin | None = None) -> None:
        _set_statement_left(self, left)
        _set_statement_right(self, right)
        _set_statement_attributes(self, attributes)
        _set_statement_span(self, span)
        _set_statement_origin(self, origin)

    def attribute(self, key: str) -> Attribute | None:
        for attribute in self.attributes:
            if attribute.key == key:
                return attribute
        return None

    def derive(self, macro: str, left, right, attributes=()) -> Statement:
        """A statement made by ``macro`` from this one (it inherits the span)."""
        return make_statement(left if type(left) is tuple else tuple(left),
                              right if type(right) is tuple else tuple(right),
                              attributes if type(attributes) is tuple else tuple(attributes),
                              self.span, Origin(macro, self))

    def origins(self) -> list[tuple[str, Statement]]:
        """(macro, parent) pairs from this statement back to the one the user wrote."""
        chain = []
        origin = self.origin
        while origin is not None:
            chain.append((origin.macro, origin.statement))
            origin = origin.statement.origin
        return chain

    def expansion(self) -> list[tuple[str, str]]:
        """(macro, text) of each expansion step from the written statement to this one."""
        steps = []
        statement = self
        while statement.origin is not None:
            steps.append((statement.origin.macro, format_statement(statement)))
            statement = statement.origin.statement
        return steps[::-1]

    def written(self) -> Statement:
        """The statement the user wrote that this one was expanded from."""
        statement = self
        while statement.origin is not None:
            statement = statement.origin.statement
        return statement

    def __str__(self) -> str:
        return format_statement(self)


_NameFields = fields_twin(Name)
_new_object = object.__new__


def make_name(text: str, span: Span | None = None,
              array: tuple[int, int] | None = None) -> Name:
    """``Name(text, span, array)`` for the passes that make names by the hundred (parsing,
    template instances): plain stores into `_NameFields`, which then becomes a Name, not a
    descriptor call per field (about 180 ns a name less)."""
    name = _new_object(_NameFields)
    name.text, name.span, name.array = text, span, array
    name.__class__ = Name
    return name


_AttributeFields = fields_twin(Attribute)


def make_attribute(key: str, value: int | str | None, span: Span | None = None) -> Attribute:
    """``Attribute(key, value, span)`` by plain stores, as `make_name`: Paddle's lists
    write `axis=N` on most of their statements."""
    attribute = _new_object(_AttributeFields)
    attribute.key, attribute.value, attribute.span = key, value, span
    attribute.__class__ = Attribute
    return attribute


_StatementFields = fields_twin(Statement)


def make_statement(left: tuple[Name, ...], right: tuple[Name, ...],
                   attributes: tuple[Attribute, ...] = (), span: Span | None = None,
                   origin: Origin | None = None) -> Statement:
    """``Statement(...)`` by plain stores, as `make_name`: macros make a statement per
    template instance and per derived step."""
    statement = _new_object(_StatementFields)
    statement.left, statement.right, statement.attributes = left, right, attributes
    statement.span, statement.origin = span, origin
    statement.__class__ = Statement
    return statement


_set_name_text, _set_name_span, _set_name_array = (
    getattr(Name, field).__set__ for field in ("text", "span", "array"))
_set_attribute_key, _set_attribute_value, _set_attribute_span = (
    getattr(Attribute, field).__set__ for field in ("key", "value", "span"))
_set_origin_macro, _set_origin_statement = (
    getattr(Origin, field).__set__ for field in ("macro", "statement"))
(_set_statement_left, _set_statement_right, _set_statement_attributes, _set_statement_span,
 _set_statement_origin) = (getattr(Statement, field).__set__
                           for field in ("left", "right", "attributes", "span", "origin"))


def format_value(value: int | str | None) -> str:
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else repr(value)


def format_statement(statement: Statement) -> str:
    """Canonical AOA text of a statement (names joined by ', ')."""
    right = [str(name) for name in statement.right]
    for attribute in statement.attributes:
        right.append(attribute.key if attribute.value is None
                     else f"{attribute.key}={format_value(attribute.value)}")
    return f"{', '.join(str(name) for name in statement.left)} -> {', '.join(right)}"


class Follower(NamedTuple):
    """A template instance set aside (share_instances): it is compiled as its group's kept
    statement, names renamed position by position. ``reads`` are its read keys, the names
    left of `->` without `^T` (a NamedTuple: a big model has tens of thousands)."""

    statement: Statement
    reads: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SharedInstances:
    """Instances of one template that are independent and laid out like ``kept``: only
    ``kept`` goes through the later passes, and its results are renamed for each follower."""

    kept: Statement
    followers: tuple[Follower, ...]


@dataclass(frozen=True, slots=True)
class Program:
    """The statements in order; ``shared`` holds the instances set aside by share_instances
    (they are part of the program: shape propagation gives them their kept one's tensors)."""

    statements: tuple[Statement, ...]
    shared: tuple[SharedInstances, ...] = ()

    def __str__(self) -> str:
        return "\n".join(format_statement(s) for s in self.statements)
