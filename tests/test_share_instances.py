"""Compiling template instances once (share_instances) changes no plan: the same copies as
expanding every instance, also when instances differ in layout or feed later statements."""

from __future__ import annotations

import pytest
from sharding import sharded

from aoa.passes import PIPELINE, share_instances
from aoa.passes.parse import texts
from aoa.pipeline import analyze, new_context, run_passes


def model(layers, experts):
    source, destination = {}, {}
    for layer in range(layers):
        for expert in range(experts):
            # layer 1 is stored in 4 shards and in bfloat16: its instances must not share
            count, dtype = (4, "bfloat16") if layer == 1 else (2, "float32")
            for name in ("gate", "up"):
                key = f"m.{layer}.e.{expert}.{name}"
                source[key] = sharded(key, (8, 4), count, 0, dtype)
            key = f"d.{layer}.e.{expert}.up_gate"
            destination[key] = sharded(key, (4, 16), 2 if expert % 2 else 4, 1, dtype)
        source[f"m.{layer}.norm"] = sharded(f"m.{layer}.norm", (4,), 1, 0)
        destination[f"d.{layer}.norm"] = sharded(f"d.{layer}.norm", (4,), 1, 0, "bfloat16")
        destination[f"t.{layer}"] = sharded(f"t.{layer}", (4,), 1, 0, "bfloat16")
    return source, destination


PROGRAMS = {
    "fused": ["m.$LAYER_ID.e.$EXPERT_ID.gate^T, m.$LAYER_ID.e.$EXPERT_ID.up^T -> "
              "d.$LAYER_ID.e.$EXPERT_ID.up_gate, fused_ffn",
              "m.$LAYER_ID.norm -> d.$LAYER_ID.norm, dtype='bfloat16'",
              "m.$LAYER_ID.norm -> t.$LAYER_ID, dtype='bfloat16'"],
    "temporaries": ["m.$LAYER_ID.e.$EXPERT_ID.gate^T, m.$LAYER_ID.e.$EXPERT_ID.up^T -> "
                    "tmp.$LAYER_ID.e.$EXPERT_ID, fused_ffn",
                    "tmp.$LAYER_ID.e.$EXPERT_ID -> d.$LAYER_ID.e.$EXPERT_ID.up_gate",
                    "m.$LAYER_ID.norm -> n.$LAYER_ID",
                    "n.$LAYER_ID -> d.$LAYER_ID.norm, dtype='bfloat16'",
                    "n.$LAYER_ID -> t.$LAYER_ID, dtype='bfloat16'"],
    # instance 1 of the t template is read again, so it cannot follow instance 0; 2 can
    "mixed": ["m.$LAYER_ID.e.$EXPERT_ID.gate^T, m.$LAYER_ID.e.$EXPERT_ID.up^T -> "
              "d.$LAYER_ID.e.$EXPERT_ID.up_gate, fused_ffn",
              "m.$LAYER_ID.norm -> t.$LAYER_ID, dtype='bfloat16'",
              "t.1 -> d.1.norm",
              "m.0.norm -> d.0.norm, dtype='bfloat16'",
              "m.2.norm -> d.2.norm, dtype='bfloat16'"],
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_shared_and_expanded_plans_are_equal(name):
    source, destination = model(3, 3)
    shared = analyze(PROGRAMS[name], source, destination)
    full = analyze(PROGRAMS[name], source, destination,
                   passes=tuple(p for p in PIPELINE if p is not share_instances))
    assert full.program.shared == ()
    followers = {f.statement.right[0].text for group in shared.program.shared
                 for f in group.followers}
    if name in ("fused", "mixed"):
        assert len(followers) > 0
    if name == "mixed":
        assert "t.2" in followers and "t.1" not in followers
    a, b = shared.plan(), full.plan()
    assert a.destinations == b.destinations
    def copies(plan):
        return sorted(repr((plan.sources[c.source], c._replace(source=0))) for c in plan.copies)

    assert copies(a) == copies(b)
    assert len(a.copies) == len(b.copies) > 0


def test_an_instance_reading_a_key_twice_is_not_the_pattern_of_others():
    """Instance (0, 0) reads `a.0.0` twice; instance (0, 1) reads `a.0.1` and `a.1.0`.
    Renaming the first instance's keys cannot say which `a.0.0` becomes which, so every
    instance must come out as its own statement says."""
    keys = [f"{i}.{j}" for i in range(2) for j in range(2)]
    source = {f"a.{k}": sharded(f"a.{k}", (2, 3), 1, 0) for k in keys}
    destination = {f"b.{k}": sharded(f"b.{k}", (4, 3), 2, 0) for k in keys}
    plan = analyze(["a.$LAYER_ID.$EXPERT_ID, a.$EXPERT_ID.$LAYER_ID -> b.$LAYER_ID.$EXPERT_ID, "
                    "axis=0"], source, destination).plan()
    read = {(plan.destinations[c.destination].key, plan.destinations[c.destination]
             .global_offset[0]): plan.sources[c.source].key for c in plan.copies}
    assert read == {(f"b.{i}.{j}", half): f"a.{j}.{i}" if half else f"a.{i}.{j}"
                    for i in range(2) for j in range(2) for half in (0, 2)}



def _renames(layers):
    """`m.$LAYER_ID.w^T -> d.$LAYER_ID.w` over ``layers`` layers laid out alike."""
    source = {f"m.{i}.w": sharded(f"m.{i}.w", (4, 8), 2, 0) for i in range(layers)}
    destination = {f"d.{i}.w": sharded(f"d.{i}.w", (8, 4), 2, 1) for i in range(layers)}
    return ["m.$LAYER_ID.w^T -> d.$LAYER_ID.w"], source, destination


class _SharingWherePays:
    """The Paddle drop-in's share_instances."""

    NAME = share_instances.NAME
    run = staticmethod(share_instances.run_where_it_pays)


@pytest.mark.parametrize(("layers", "written", "pays"), [
    (2, "m.$LAYER_ID.w^T -> d.$LAYER_ID.w", False),  # two instances of a rename
    (2, "m.0.w^T -> d.0.w", False),  # no template
    (3, "m.$LAYER_ID.w^T -> d.$LAYER_ID.w", True),  # three instances
    (2, "m.$LAYER_ID.w^T -> d.$LAYER_ID.w, dtype='float32'", True),  # a cast
])
def test_sharing_pays_for_three_instances_or_more_than_a_rename(layers, written, pays):
    _, source, destination = _renames(layers)
    ctx = new_context(source, destination)
    program = run_passes(texts([written]), ctx, PIPELINE[:PIPELINE.index(share_instances)])
    assert share_instances.pays(program) is pays
    shared = share_instances.run_where_it_pays(program, ctx)
    assert (shared is program) is not pays
    full = [analyze(*_renames(layers), passes=passes).plan() for passes in (
        PIPELINE, tuple(_SharingWherePays if p is share_instances else p for p in PIPELINE))]
    assert full[0].destinations == full[1].destinations and full[0].copies == full[1].copies


def test_a_fused_template_of_two_instances_pays():
    source, destination = model(2, 1)
    ctx = new_context(source, destination)
    program = run_passes(texts(PROGRAMS["fused"]), ctx,
                         PIPELINE[:PIPELINE.index(share_instances)])
    assert share_instances.pays(program)
