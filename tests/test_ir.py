"""The IR's fast constructors make the same objects as the classes' own."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from aoa.ir import Attribute, Name, Statement, make_attribute, make_name, make_statement
from aoa.source import SourceText, Span


@pytest.mark.parametrize("args", [("a.w",), ("a.w^T", None, (0, 3)),
                                  ("b", Span(SourceText("<s>", "b -> c"), 1, 1, 1, 2))])
def test_make_name_is_a_name(args):
    made, built = make_name(*args), Name(*args)
    assert type(made) is Name
    assert made == built and hash(made) == hash(built)
    assert repr(made) == repr(built) and str(made) == str(built)
    assert (made.text, made.span, made.array) == (built.text, built.span, built.array)
    assert pickle.loads(pickle.dumps(made)) == built
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.text = "other"  # type: ignore[misc]


def test_make_statement_is_a_statement():
    span = Span(SourceText("<s>", "a -> b"), 1, 1, 1, 7)
    args = ((Name("a"),), (Name("b"),), (Attribute("axis", 1),), span, None)
    made, built = make_statement(*args), Statement(*args)
    assert type(made) is Statement
    assert made == built and hash(made) == hash(built)
    assert repr(made) == repr(built) and str(made) == str(built)
    assert (made.span, made.origin) == (built.span, built.origin)
    derived = made.derive("id", [Name("c")], [Name("d")])
    assert derived.origins() == [("id", made)] and derived.written() is made
    assert pickle.loads(pickle.dumps(made)) == built
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.left = ()  # type: ignore[misc]


@pytest.mark.parametrize("args", [("axis", 0), ("fused_ffn", None), ("dtype", "bfloat16",
                                  Span(SourceText("<s>", "a -> b, dtype='bfloat16'"), 1, 9, 1,
                                       25))])
def test_make_attribute_is_an_attribute(args):
    made, built = make_attribute(*args), Attribute(*args)
    assert type(made) is Attribute
    assert made == built and hash(made) == hash(built) and repr(made) == repr(built)
    assert (made.key, made.value, made.span) == (built.key, built.value, built.span)
    assert pickle.loads(pickle.dumps(made)) == built
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.key = "other"  # type: ignore[misc]
