"""The IR's fast constructors make the same objects as the classes' own."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from aoa.ir import Name, make_name
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
