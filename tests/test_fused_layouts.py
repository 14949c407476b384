"""The fused macros' names and layouts (issue 16's reproducers), bytes against numpy.

Hygienic names: what a macro makes never stands in for a tensor of the program or the
checkpoint. Reverse runs of fused_qkv_old with grouped heads are the true inverse. A fused
tensor that reaches its keys through a split, a concat or a second fused statement is laid
out as the stored tensors say. An alias never uses its axis. (Refusals and ambiguities are
pinned with their messages in tests/golden/errors.)
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy_programs import ffn_fuse, ffn_unfuse, qkv_fuse, qkv_old_fuse
from sharding import sharded

import aoa
from aoa.passes import expand_fused, through
from aoa.passes.parse import texts
from aoa.pipeline import new_context, run_passes
from aoa.runtime import reference


def layout(spec: dict) -> dict:
    """{key: shape} or {key: (shape, shards, axis)} -> shard descriptions."""
    info = {}
    for key, value in spec.items():
        shape, shards, axis = value if isinstance(value[0], tuple) else (value, 1, 0)
        info[key] = sharded(key, shape, shards, axis)
    return info


def run(statements, sources: dict, destination: dict, arrays: dict, *, reverse=False):
    """Every destination key's whole array, assembled from the shards the plan writes."""
    plan = aoa.compile(statements, layout(sources), layout(destination), reverse=reverse)
    whole: dict[str, np.ndarray] = {}
    for shard, out in zip(plan.destinations, reference.run_plan_on_arrays(plan, arrays),
                          strict=True):
        target = whole.setdefault(shard.key, np.zeros(shard.global_shape, out.dtype))
        target[tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape))] \
            = out
    return whole


def random(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.shape == want.shape and got.tobytes() == np.ascontiguousarray(want).tobytes()


# 1. hygienic names ------------------------------------------------------------------------

def test_fused_qkv_pieces_do_not_capture_a_source_key():
    """Paddle names the pieces of `a1` as a10, a11: `a10 -> out` then reads a piece."""
    a1, k, v, a10 = random((2, 2), (2, 1), (2, 1), (2, 1))
    got = run(["a1, k, v -> f, fused_qkv, num_heads=2, num_key_value_groups=1",
               "a10 -> out"],
              {"a1": (2, 2), "k": (2, 1), "v": (2, 1), "a10": (2, 1)},
              {"f": (2, 4), "out": (2, 1)}, {"a1": a1, "k": k, "v": v, "a10": a10})
    assert same(got["out"], a10)
    assert same(got["f"], qkv_fuse(a1, k, v, 2, 1, axis=1))


def test_fused_qkv_parts_whose_piece_names_meet():
    """q named `a` and k named `a1`: Paddle's pieces a10 (q's) and a10 (k's) collide."""
    a, a1, v = random((2, 12), (2, 1), (2, 1))
    got = run(["a, a1, v -> f, fused_qkv, num_heads=12, num_key_value_groups=1"],
              {"a": (2, 12), "a1": (2, 1), "v": (2, 1)}, {"f": (2, 14)},
              {"a": a, "a1": a1, "v": v})
    assert same(got["f"], qkv_fuse(a, a1, v, 12, 1, axis=1))


@pytest.mark.parametrize("trap", ["fused_ffn_tmp.GATE_0", "fused_ffn_tmp.UP_1",
                                  "fused_qkv_old_tmp.Q_0", "fused_qkv_tmp.K_0",
                                  "w_transpose_tmp"])
@pytest.mark.parametrize("as_source", [True, False])
def test_a_tensor_named_like_a_piece_keeps_its_own_data(trap, as_source):
    """A source key, or a temporary that lives across the fused statements, named like a
    piece or view a macro makes: it is read back unchanged."""
    x, w, q, k, v, g = random((3, 3), (4, 8), (4, 4), (4, 2), (4, 2), (3, 4))
    head = [] if as_source else [f"x -> {trap}"]
    statements = [*head,
                  "w -> f, fused_ffn",
                  "q, k, v -> qkv, fused_qkv_old, num_heads=2, num_key_value_groups=1",
                  "q2, k2, v2 -> grouped, fused_qkv, num_heads=2, num_key_value_groups=1",
                  "w^T -> wt",
                  f"{trap} -> out"]
    sources = {"w": ((4, 8), 2, 1), "q": (4, 4), "k": (4, 2), "v": (4, 2),
               "q2": (4, 4), "k2": (4, 2), "v2": (4, 2), "g": (3, 4),
               ("x" if not as_source else trap): (3, 3)}
    arrays = {"w": w, "q": q, "k": k, "v": v, "q2": q, "k2": k, "v2": v, "g": g,
              ("x" if not as_source else trap): x}
    got = run(statements, sources,
              {"f": ((4, 8), 4, 1), "qkv": ((4, 8), 1, 1), "grouped": (4, 8), "wt": (8, 4),
               "out": (3, 3)}, arrays)
    assert same(got["out"], x)
    assert same(got["f"], ffn_fuse(*ffn_unfuse(w, 2, 1), 4, 1))
    assert same(got["wt"], w.T)


def test_generated_names_avoid_every_name_in_use():
    """The pieces move to another prefix when a key starts with theirs; views get a number."""
    ctx = new_context(
        layout({"w": (8, 2), "w_transpose_tmp": (1, 1), "fused_ffn_tmp.GATE_0.x": (1, 1)}),
        layout({"f": (2, 8), "u": (1, 1), "fused_ffn_tmp.GATE_0.x": (1, 1)}))
    expanded = run_passes(texts("w^T -> f, fused_ffn\nw_transpose_tmp -> u"), ctx,
                          through(expand_fused))
    made = {n.base for s in expanded.statements for n in (*s.left, *s.right)}
    assert made == {"w", "w_transpose_tmp_1", "w_transpose_tmp", "f", "u",
                    "fused_ffn_tmp_1.GATE_0", "fused_ffn_tmp_1.UP_0"}


# 2. the reverse of fused_qkv_old with grouped heads ---------------------------------------

def test_reverse_fused_qkv_old_gives_the_parts_back():
    """The issue's case: q = f[0:4], k = f[4:5], v = f[5:6]."""
    (f,) = random((6, 2))
    got = run(["q, k, v -> f, fused_qkv_old, num_heads=4, num_key_value_groups=1, axis=0"],
              {"f": (6, 2)}, {"q": (4, 2), "k": (1, 2), "v": (1, 2)}, {"f": f}, reverse=True)
    assert same(got["q"], f[0:4]) and same(got["k"], f[4:5]) and same(got["v"], f[5:6])


@pytest.mark.parametrize(("heads", "groups", "tp"), [
    (4, 1, 1), (4, 2, 2), (8, 2, 2), (6, 3, 3), (8, 4, 4), (12, 4, 2), (16, 8, 8), (4, 4, 4)])
@pytest.mark.parametrize("axis", [0, 1])
def test_fused_qkv_old_merge_runs_back_per_rank(heads, groups, tp, axis):
    """Forward: per rank [q_r | k_r | v_r]; reverse of the same statement: q, k, v again."""
    head, other = 2, 3

    def shape(n):
        return (n * head, other) if axis == 0 else (other, n * head)

    q, k, v = random(shape(heads), shape(groups), shape(groups), seed=heads * tp)
    statement = [f"q, k, v -> f, fused_qkv_old, num_heads={heads}, "
                 f"num_key_value_groups={groups}, axis={axis}"]
    fused = (shape(heads + 2 * groups), tp, axis)
    parts = {"q": shape(heads), "k": shape(groups), "v": shape(groups)}
    loaded = run(statement, parts, {"f": fused}, {"q": q, "k": k, "v": v})
    assert same(loaded["f"], qkv_old_fuse(q, k, v, heads, groups, tp, axis))
    back = run(statement, {"f": fused}, parts, {"f": loaded["f"]}, reverse=True)
    assert same(back["q"], q) and same(back["k"], k) and same(back["v"], v)


# 4. an alias with an axis it never uses ----------------------------------------------------

def test_alias_with_an_axis_out_of_range_is_the_same_tensor():
    (a,) = random((2, 2))
    got = run(["a -> b, axis=2"], {"a": (2, 2)}, {"b": (2, 2)}, {"a": a})
    assert same(got["b"], a)


# 6. which layout a fused tensor follows -----------------------------------------------------

def test_fused_tensor_reaching_its_keys_through_a_split():
    """`t -> top, bottom, axis=0`: t is laid out for the shards of top and bottom."""
    (w,) = random((4, 8))
    got = run(["w -> t, fused_ffn", "t -> top, bottom, axis=0"], {"w": (4, 8)},
              {"top": ((2, 8), 2, 1), "bottom": ((2, 8), 2, 1)}, {"w": w})
    fused = ffn_fuse(*ffn_unfuse(w, 1, 1), 2, 1)
    assert same(got["top"], fused[:2]) and same(got["bottom"], fused[2:])


def test_fused_tensor_read_from_a_concat():
    """`a, b -> t, axis=0`: t is laid out as a and b are (4 shards each)."""
    a, b = random((1, 8), (1, 8))
    got = run(["a, b -> t, axis=0", "t -> g, u, fused_ffn"],
              {"a": ((1, 8), 4, 1), "b": ((1, 8), 4, 1)}, {"g": (2, 4), "u": (2, 4)},
              {"a": a, "b": b})
    gate, up = ffn_unfuse(np.concatenate([a, b]), 4, 1)
    assert same(got["g"], gate) and same(got["u"], up)


def test_fused_tensor_between_two_fused_statements():
    """Between them t has one shard; the result is w re-laid from 2 shards to 4."""
    (w,) = random((2, 8))
    got = run(["w -> t, fused_ffn", "t -> d, fused_ffn"], {"w": ((2, 8), 2, 1)},
              {"d": ((2, 8), 4, 1)}, {"w": w})
    assert same(got["d"], ffn_fuse(*ffn_unfuse(w, 2, 1), 4, 1))


def test_fused_tensor_to_a_key_and_into_another_fused_statement():
    """t goes to `plain` (2 shards) and into a second fused_ffn: both read t in the layout
    that `plain` gives it."""
    (w,) = random((2, 8))
    got = run(["w -> t, fused_ffn", "t -> plain", "t -> d, fused_ffn"],
              {"w": ((2, 8), 4, 1)}, {"plain": ((2, 8), 2, 1), "d": ((2, 8), 1, 1)}, {"w": w})
    halves = ffn_unfuse(w, 4, 1)
    assert same(got["plain"], ffn_fuse(*halves, 2, 1))
    assert same(got["d"], ffn_fuse(*halves, 1, 1))


# 3. merges: refused where the parts are out of proportion, except over one shard ---------

def test_forward_merge_over_one_shard_is_the_plain_concat():
    """Paddle's cut into equal pieces and join gives the parts one after the other."""
    g, u, q, k, v = random((2, 2), (6, 2), (3, 2), (3, 2), (2, 2))
    got = run(["g^T, u^T -> f, fused_ffn",
               "q, k, v -> qkv, fused_qkv_old, num_heads=2, num_key_value_groups=1, axis=0"],
              {"g": (2, 2), "u": (6, 2), "q": (3, 2), "k": (3, 2), "v": (2, 2)},
              {"f": (2, 8), "qkv": (8, 2)}, {"g": g, "u": u, "q": q, "k": k, "v": v})
    assert same(got["f"], np.concatenate([g.T, u.T], axis=1))
    assert same(got["qkv"], np.concatenate([q, k, v]))


@pytest.mark.parametrize(("statement", "sources", "fused", "reverse"), [
    ("g^T, u^T -> f, fused_ffn", {"g": (2, 2), "u": (6, 2)}, ((2, 8), 2, 1), False),
    ("f -> g, u, fused_ffn", {"g": (2, 2), "u": (2, 6)}, ((2, 8), 1, 1), True),
    ("q, k, v -> f, fused_qkv_old, num_heads=2, num_key_value_groups=2, axis=0",
     {"q": (4, 2), "k": (2, 2), "v": (2, 2)}, ((8, 2), 2, 0), False),
    ("f -> q, k, v, fused_qkv_old, num_heads=4, num_key_value_groups=1, axis=0",
     {"q": (4, 2), "k": (2, 2), "v": (1, 2)}, ((7, 2), 1, 0), True),
])
def test_merge_out_of_proportion_is_refused(statement, sources, fused, reverse):
    """Over several shards (a forward run would mix halves or heads between ranks) and in
    reverse (no forward run gives such parts)."""
    with pytest.raises(aoa.ValidationError, match="cannot merge"):
        aoa.compile([statement], layout(sources), layout({"f": fused}), reverse=reverse)


# 5. where the spec is silent ---------------------------------------------------------------

def test_statements_glued_in_one_item_are_each_expanded_alone():
    """Paddle runs the macro over the whole item and drops `x -> y` (KeyError 'y')."""
    w, x = random((2, 4), (2, 2))
    got = run(["w -> t, fused_ffn x -> y", "x -> z a.$LAYER_ID -> b.$LAYER_ID"],
              {"w": (2, 4), "x": (2, 2), "a.0": (2, 2)},
              {"t": ((2, 4), 2, 1), "y": (2, 2), "z": (2, 2), "b.0": (2, 2)},
              {"w": w, "x": x, "a.0": x})
    assert same(got["t"], ffn_fuse(*ffn_unfuse(w, 1, 1), 2, 1))
    assert same(got["y"], x) and same(got["z"], x) and same(got["b.0"], x)


def test_full_export_of_a_one_shard_fused_split_keeps_the_written_names():
    """Paddle's one-piece step is an alias, so its export says fused_ffn_tmp.GATE_0."""
    (f,) = random((2, 4))
    plan = aoa.compile(["f -> g, u, fused_ffn"], layout({"f": (2, 4)}), None)
    outputs = dict(zip((s.key for s in plan.destinations),
                       reference.run_plan_on_arrays(plan, {"f": f}), strict=True))
    assert sorted(outputs) == ["g", "u"]
    assert same(outputs["g"], f[:, :2]) and same(outputs["u"], f[:, 2:])
