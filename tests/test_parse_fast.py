"""The parser's fast path (`_fast_parse`, no Lark) gives exactly what Lark's path gives, spans
included, or declines (None) and leaves the text, and any error in it, to Lark."""

from __future__ import annotations

import json
from pathlib import Path

from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from aoa.errors import AoaError
from aoa.passes.parse import _fast_parse, _lark_parse, parse_source
from aoa.source import SourceText

GOLDEN = Path(__file__).parent / "golden"


def _texts(value) -> list[str]:
    if isinstance(value, str):
        return [value] if "->" in value else []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return [text for item in items for text in _texts(item)]


def golden_texts() -> list[str]:
    return sorted({text for path in GOLDEN.rglob("*.json")
                   for text in _texts(json.loads(path.read_text()))})


def _full(statements) -> list:
    """Statements with every span, which equality leaves out."""
    return [(s, s.span, [(n, n.span) for n in s.left + s.right],
             [(a, a.span) for a in s.attributes]) for s in statements]


def assert_same(text: str) -> bool:
    """Fast path and Lark agree on ``text``; whether the fast path took it."""
    source = SourceText("<t>", text)
    fast = _fast_parse(source)
    try:
        expected = _lark_parse(source)
    except AoaError:
        assert fast is None, text
        return False
    if fast is None:
        return False
    assert _full(fast) == _full(expected), text
    return True


def test_golden_statements_take_the_fast_path_and_agree() -> None:
    texts = golden_texts()
    assert len(texts) > 200
    taken = [text for text in texts if assert_same(text)]
    assert len(taken) > 200
    # a whole file of them, on many lines, with comments and blank lines
    program = "\n# a comment\n\r\n".join(taken[:50]) + "  # last\n"
    assert assert_same(program)
    assert len(parse_source(SourceText("<t>", program))) >= 50


def test_fast_path_shapes() -> None:
    for text in ["a -> b", "a, b -> c, axis=1", "a[0:3] -> b[0:3]", "a -> b c -> d",
                 "a -> b, fused_ffn", "a -> b, dtype='float32'", 'a -> b, dtype="x#y"',
                 "a^T -> b, tp_probe_key=w", "x.$EXPERT_ID.w -> y, num_heads=8, fused_qkv",
                 "a -> b, axis=1p -> q", "a -> b\r\nc -> d", "a -> b\r\rc -> d",
                 "a -> fused_ffn", "a->fused_ffn, fused_qkv", "a -> fused_ffn, b",
                 "a -> b, \u0661\u0662", "a [ 0 : 2 ] -> b", "   ", ""]:
        assert_same(text)
    assert assert_same("a -> b c -> d")
    for bad in ["a -> b, axis=1, c", "a -> axis=1", "a -> b, axis=x", "a ->", "-> b",
                "a -> b, axis=-1", "a -> b, axis=" + "9" * 40, "a[0:1 -> b", "a -> b[0:",
                "a, -> b", "a -> b,", "a -> b, axis=1 fused_ffn, c", "1a -> b", "a -> b = c"]:
        assert not assert_same(bad), bad


PIECES = ["a", "b", "x.$LAYER_ID.w", "w^T", "->", ",", " ", "  ", "\n", "\r", "#c", "=", "1",
          "12", "[", "]", ":", "axis", "fused_ffn", "dtype", "'f32'", '"s"', "tp_probe_key",
          "-", "0", "*", "\t", "é", "a -> b", " -> ", ", ", ", axis=1", ", fused_ffn", "[0:2]",
          "\n", "x.w -> y.w", ", dtype='bf16'"]


@fuzz_settings
@given(st.lists(st.sampled_from(PIECES), max_size=25))
def test_fast_path_agrees_with_lark_on_any_text(pieces: list[str]) -> None:
    assert_same("".join(pieces))
