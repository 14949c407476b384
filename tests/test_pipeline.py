"""The pipeline as data: the passes in order, each named after its module, the form of the IR
each leaves, and a README that names every one of them."""

from __future__ import annotations

import functools
import gc
import re
from pathlib import Path

import pytest
from sharding import sharded

import aoa
from aoa.ir import Program
from aoa.passes import PIPELINE, expand_macros, propagate_shapes, through
from aoa.passes.plan import PlannedProgram
from aoa.passes.resolve_chains import ChainedProgram
from aoa.pipeline import analyze
from aoa.symbolic import SymbolicTensors

README = Path(__file__).resolve().parents[1] / "README.md"


def test_each_pass_is_named_after_its_module():
    assert [p.NAME for p in PIPELINE] == [p.__name__.rpartition(".")[2] for p in PIPELINE]
    assert [p.NAME for p in PIPELINE] == ["parse", "expand_macros", "share_instances",
                                          "resolve_chains", "expand_fused",
                                          "propagate_shapes", "check_mapping", "plan"]


def test_the_readme_lists_every_pass_in_order():
    text = README.read_text()
    block = text[text.index("python/aoa/passes/"):text.index("python/aoa/pipeline.py")]
    assert re.findall(r"^\s+(\w+)\.py", block, re.MULTILINE) == [p.NAME for p in PIPELINE]


def test_the_hook_sees_each_pass_and_the_form_it_leaves():
    seen = []
    compilation = analyze(
        "w^T -> t\nt -> v, dtype='bfloat16'\n", {"w": sharded("w", (4, 8), 2, 0)},
        {"v": sharded("v", (8, 4), 2, 1, "bfloat16")},
        after_pass=lambda name, ir, ctx, seconds: seen.append((name, type(ir), seconds >= 0)))
    assert seen == [("parse", Program, True), ("expand_macros", Program, True),
                    ("share_instances", Program, True), ("resolve_chains", ChainedProgram, True),
                    ("expand_fused", Program, True), ("propagate_shapes", SymbolicTensors, True),
                    ("check_mapping", SymbolicTensors, True), ("plan", PlannedProgram, True)]
    assert compilation.planned is not None and compilation.plan() is compilation.planned
    assert [str(s) for s in compilation.program.statements] == [
        "w -> w_transpose_tmp, permute='[]'", "w_transpose_tmp -> t",
        "t -> v, dtype='bfloat16'"]


def test_stopping_after_propagate_shapes_plans_on_demand():
    compilation = analyze("w -> v", {"w": sharded("w", (4,), 1, 0)}, None,
                          passes=through(propagate_shapes))
    assert compilation.planned is None
    assert [d.key for d in compilation.plan().destinations] == ["v"]
    with pytest.raises(TypeError, match="at least through propagate_shapes"):
        analyze("w -> v", {"w": sharded("w", (4,), 1, 0)}, None, passes=through(expand_macros))


def test_a_template_matches_the_keys_with_digits_where_its_ids_are():
    """An id is a run of digits between the template's texts, which may hold digits of their
    own (`fc1`); keys that end alike past their last digit (`m.3.fc2.w`) or hold no id
    (`m.x.fc1.w`) are not instances. Ids come in numeric order."""
    keys = ["m.0.fc1.w", "m.12.fc1.w", "m.3.fc2.w", "m.x.fc1.w", "m.4.fc1.w.b", "n.5.fc1.w",
            "m.7.fc1.w", "m.1.e.2.w", "m.1.e.x.w", "m.10.e.3.w", "m.10.e.2.w", "m.1.e.3.w"]
    expanded = []
    analyze(["m.$LAYER_ID.fc1.w -> o.$LAYER_ID.w", "m.$LAYER_ID.e.$EXPERT_ID.w -> "
             "p.$LAYER_ID.$EXPERT_ID.w"], {k: sharded(k, (2,), 1, 0) for k in keys},
            after_pass=lambda name, ir, ctx, seconds: name == "expand_macros"
            and expanded.extend(map(str, ir.statements)))
    assert expanded == ["m.0.fc1.w -> o.0.w", "m.7.fc1.w -> o.7.w", "m.12.fc1.w -> o.12.w",
                        "m.1.e.2.w -> p.1.2.w", "m.10.e.2.w -> p.10.2.w",
                        "m.1.e.3.w -> p.1.3.w", "m.10.e.3.w -> p.10.3.w"]


def test_boxes_side_by_side_are_told_apart_without_comparing_pairs():
    """The plan pass's shortcut before its pair-by-pair check for boxes written twice: True
    only for boxes alike but along one axis, where none overlaps the next."""
    from aoa.passes.plan import _side_by_side
    row = [((0, 4), (8, 6), "b"), ((0, 0), (8, 4), "a"), ((0, 6), (8, 9), "c")]
    assert _side_by_side(row)
    assert _side_by_side([((2,), (5,), "a"), ((0,), (2,), "b")])
    assert not _side_by_side([((0, 0), (8, 4), "a"), ((0, 3), (8, 6), "b")])  # overlap
    assert not _side_by_side([((0, 0), (4, 4), "a"), ((4, 4), (8, 8), "b")])  # two axes
    assert not _side_by_side([((), (), "a"), ((), (), "b")])  # 0-d: left to the pairs


def test_compiling_leaves_none_of_a_models_keys_in_aoa_s_caches():
    """A long-lived process (a Paddle loader with the drop-in) compiles model after model: a
    cache that kept each model's keys made every later engine slower (bench/README.md, goal
    1's ninth round) and would grow with every checkpoint."""
    count = 300
    keys = [f"model.layers.{n}.w{suffix}" for n in range(count // 2) for suffix in ("", ".w_0")]
    before = _aoa_cache_sizes()
    aoa.compile("model.layers.$LAYER_ID.w -> layers.$LAYER_ID.w",
                {key: sharded(key, (4,), 2, 0) for key in keys})
    grown = {name: size - before.get(name, 0) for name, size in _aoa_cache_sizes().items()}
    assert grown and max(grown.values()) < count // 10, grown


def _aoa_cache_sizes() -> dict[str, int]:
    """Entries in each `functools` cache of aoa's modules."""
    return {f"{wrapper.__module__}.{wrapper.__qualname__}": wrapper.cache_info().currsize
            for wrapper in gc.get_objects()
            if isinstance(wrapper, functools._lru_cache_wrapper)
            and wrapper.__module__.startswith("aoa")}
