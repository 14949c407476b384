"""Where Paddle 3.3.1 raises on a program whose meaning is plain, aoa does what it says
(policy 0.2), or says what to write instead; the programs Paddle computes are frozen from it in
tests/golden/paddle_crosscheck (`keyword_names`, `cast_then_concat`).

- Q21: a tensor spelled as an attribute keyword (`axis`, `dtype`, ...). Paddle's chain
  macro cannot read `axis -> dtype` ("AssertionError: Left or right variable must have the
  only one element"), nor a split or a temporary so named. aoa reads names as names.
- Q28: a cast keeps the dtype Paddle records, so a float32 tensor cast to float16, joined
  with a float16 one, raises there ("All tensors must have the same dtype when
  concatenating"). aoa joins tensors whose bytes are one dtype, and names the dtypes as
  cast where they are not.
- Q8: a template with $LAYER_ID and $EXPERT_ID takes every id of one with every id of the
  other, so layers holding different experts ask for keys no layer has (Paddle: "ValueError:
  l.1.e.1.w should be assigned before!"). aoa names the key and says why it was asked for.
- A template name with `^T`: Paddle's `*` fails to parse what it makes of `e.*.w^T`
  ("SyntaxError: Expected TokenType.IDENTIFIER, got TokenType.RARROW"), and its
  $LAYER_ID_OFFSET looks for keys ending in `^T`, finds none and drops the statement. aoa
  transposes each instance, as Paddle's $LAYER_ID does.

Each tensor is loaded by the kernel from a file the `safetensors` package wrote and
compared with numpy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from safetensors_files import save_folder

import aoa

RNG = np.random.default_rng(21)
A = RNG.standard_normal((2, 4)).astype(np.float32)
HALF = RNG.standard_normal((2, 4)).astype(np.float16)
BRAIN = RNG.standard_normal((2, 4)).astype(ml_dtypes.bfloat16)


def loaded(tmp_path, statements: list[str], source: dict[str, np.ndarray],
           into: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    aoa.load(statements, source=save_folder(tmp_path, source), into=into, progress=False)
    return into


def test_tensors_named_as_keywords_are_renamed_split_and_chained(tmp_path):
    """(A name that is a fused macro's flag, `fused_ffn`, is that flag right of `->`, in
    Paddle as in aoa.)"""
    source = {"axis": A, "dtype": A[::-1].copy(), "num_heads": A * 2}
    into = {"src_dtype": np.zeros((4, 2), np.float32),
            "num_key_value_groups": np.zeros((1, 4), np.float32),
            "dst_dtype": np.zeros((1, 4), np.float32), "out": np.zeros((2, 4), np.float32)}
    statements = ["dtype^T -> src_dtype",
                  "num_heads -> num_key_value_groups, dst_dtype, axis=0",
                  "axis -> permute", "permute -> out"]
    got = loaded(tmp_path, statements, source, into)
    want = {"src_dtype": A[::-1].T, "num_key_value_groups": A[:1] * 2, "dst_dtype": A[1:] * 2,
            "out": A}
    for key, value in want.items():
        assert got[key].tobytes() == value.tobytes(), key


def test_a_template_takes_names_as_written_from_a_keyword_on(tmp_path):
    """Paddle asks a template's placeholders only of the names before one spelled as a
    keyword; `axis, layers.$LAYER_ID.w` (where it raises in its chain macro) joins `axis`
    to each layer, as `layers.$LAYER_ID.w, axis` does in Paddle."""
    source = {"axis": A, "layers.0.w": A + 1, "layers.1.w": A + 2}
    into = {f"x.{i}.w": np.zeros((4, 4), np.float32) for i in (0, 1)}
    got = loaded(tmp_path, ["axis, layers.$LAYER_ID.w -> x.$LAYER_ID.w, axis=0"], source, into)
    for layer in (0, 1):
        want = np.concatenate([A, A + 1 + layer])
        assert got[f"x.{layer}.w"].tobytes() == want.tobytes()


def test_a_name_before_the_keyword_still_carries_the_placeholder():
    source = {"axis": [aoa.ShardDesc.full("axis", (2, 4), "float32")],
              "shared": [aoa.ShardDesc.full("shared", (2, 4), "float32")],
              "layers.0.w": [aoa.ShardDesc.full("layers.0.w", (2, 4), "float32")]}
    with pytest.raises(aoa.AoaError) as raised:
        aoa.compile(["layers.$LAYER_ID.w, shared, axis -> x.$LAYER_ID.w, axis=0"], source)
    assert raised.value.render().splitlines()[0] == (
        "<statement 0>:1:21: error: 'shared' lacks $LAYER_ID, which every name of this "
        "template must carry")


def test_tensors_cast_to_one_dtype_are_joined(tmp_path):
    source = {"a": A, "half": HALF, "brain": BRAIN}
    into = {"c": np.zeros((6, 4), np.float16)}
    statements = ["a -> a16, dtype='float16'", "brain -> brain16, dtype='float16'",
                  "a16, half, brain16 -> c, axis=0"]
    got = loaded(tmp_path, statements, source, into)
    want = np.concatenate([A.astype(np.float16), HALF,
                           BRAIN.astype(np.float32).astype(np.float16)])
    assert got["c"].tobytes() == want.tobytes()


@pytest.mark.parametrize(("statements", "message"), [
    (["a -> a16, dtype='float16'", "a16, brain -> c, axis=0"],
     "<statement 1>:1:6: error: cannot concatenate 'brain' (bfloat16) with 'a16' (float32, "
     "cast to float16): the dtypes differ"),
    (["a -> a16, dtype='float16'", "a16, a -> m, axis=0", "m, half -> c, axis=0"],
     "<statement 2>:1:4: error: cannot concatenate 'half' (float16) with 'm' (pieces in "
     "float16 and float32): the dtypes differ"),
    (["a, half -> c, axis=0"],
     "<statement 0>:1:4: error: cannot concatenate 'half' (float16) with 'a' (float32): the "
     "dtypes differ"),
])
def test_tensors_in_different_dtypes_are_not_joined(statements, message):
    source = {key: [aoa.ShardDesc.full(key, (2, 4), dtype)]
              for key, dtype in (("a", "float32"), ("half", "float16"), ("brain", "bfloat16"))}
    with pytest.raises(aoa.AoaError) as raised:
        aoa.compile(statements, source)
    lines = raised.value.render().splitlines()
    assert lines[0] == message
    assert lines[-1] == "  hint: Cast the tensors to one dtype after the concat."


def test_templates_with_a_transposed_name_transpose_each_instance(tmp_path):
    source = {"e.0.w": A, "e.1.w": A + 1, "l.1.w": A + 2, "l.2.w": A + 3}
    into = {"s": np.zeros((8, 2), np.float32), "o.0.w": np.zeros((4, 2), np.float32),
            "o.1.w": np.zeros((4, 2), np.float32)}
    got = loaded(tmp_path, ["e.*.w^T -> s, axis=0",
                            "l.$LAYER_ID_OFFSET.w^T -> o.$LAYER_ID_OFFSET.w"], source, into)
    want = {"s": np.concatenate([A.T, (A + 1).T]), "o.0.w": (A + 2).T, "o.1.w": (A + 3).T}
    for key, value in want.items():
        assert got[key].tobytes() == value.tobytes(), key


def test_a_template_over_layers_of_different_experts_says_why_a_key_is_missing():
    source = {key: [aoa.ShardDesc.full(key, (2, 4), "float32")]
              for key in ("l.0.e.0.w", "l.0.e.1.w", "l.1.e.0.w")}
    with pytest.raises(aoa.AoaError) as raised:
        aoa.compile(["l.$LAYER_ID.e.$EXPERT_ID.w -> o.$LAYER_ID.e.$EXPERT_ID.w"], source)
    lines = raised.value.render().splitlines()
    assert lines[0] == ("<statement 0>:1:1: error: 'l.1.e.1.w' is neither a source key nor "
                        "assigned before")
    assert lines[-1] == (
        "  hint: A template with both placeholders takes every $LAYER_ID found with every "
        "$EXPERT_ID found (spec 5.3, quirk Q8): where layers hold different experts, write a "
        "template for each group of them.")
