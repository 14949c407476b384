"""A forward (load) program and the same program run with reverse=True (export) are inverses,
also for fused layouts under tensor parallelism (spec 0.4; Paddle de-fuses with TP=1, Q24)."""

from __future__ import annotations

import numpy as np
import pytest
from sharding import sharded

import aoa
from aoa.runtime import reference

PROGRAMS = {
    "fused_ffn": ["model.layers.$LAYER_ID.gate^T, model.layers.$LAYER_ID.up^T -> "
                  "layers.$LAYER_ID.up_gate, fused_ffn"],
    "fused_ffn_split_form": ["fused.$LAYER_ID -> layers.$LAYER_ID.gate, layers.$LAYER_ID.up, "
                             "fused_ffn"],
    "fused_qkv": ["model.layers.$LAYER_ID.q^T, model.layers.$LAYER_ID.k^T, "
                  "model.layers.$LAYER_ID.v^T -> layers.$LAYER_ID.qkv, fused_qkv, num_heads=4, "
                  "num_key_value_groups=2"],
    "fused_qkv_old": ["model.layers.$LAYER_ID.qkv^T -> layers.$LAYER_ID.qkv, fused_qkv_old, "
                      "num_heads=8, num_key_value_groups=4"],
}
SOURCES = {
    "fused_ffn": {"model.layers.0.gate": (8, 4), "model.layers.0.up": (8, 4)},
    "fused_ffn_split_form": {"fused.0": (4, 16)},
    "fused_qkv": {"model.layers.0.q": (8, 4), "model.layers.0.k": (4, 4),
                  "model.layers.0.v": (4, 4)},
    "fused_qkv_old": {"model.layers.0.qkv": (16, 4)},
}


def gather(plan, outputs):
    whole = {}
    for shard, array in zip(plan.destinations, outputs):
        target = whole.setdefault(shard.key, np.zeros(shard.global_shape, np.float32))
        target[tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape))] \
            = array
    return whole


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_reverse_undoes_forward(name, tp):
    rng = np.random.default_rng(tp)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in SOURCES[name].items()}
    source = {k: sharded(k, s, 1, 0) for k, s in SOURCES[name].items()}
    produced = aoa.pipeline.analyze(PROGRAMS[name], source, None).destination_shards()
    destination = {t.key: sharded(t.key, t.global_shape, tp, len(t.global_shape) - 1)
                   for t in produced}
    forward = aoa.compile(PROGRAMS[name], source, destination)
    loaded = gather(forward, reference.run_plan_on_arrays(forward, tensors))
    back = aoa.compile(PROGRAMS[name], destination, None, reverse=True)
    exported = gather(back, reference.run_plan_on_arrays(back, loaded))
    assert set(exported) == set(tensors)
    for key, value in tensors.items():
        assert exported[key].tobytes() == value.tobytes(), key


def test_a_concat_of_unequal_parts_run_backwards_says_why_it_has_no_inverse():
    """Run backwards, `a, b -> c, axis=0` splits c into equal parts, as Paddle's reverse mode
    does: with a of 4 rows and b of 2, a would get 3 rows (Paddle answers so)."""
    source = {"c": [aoa.ShardDesc("c", (6, 4), (6, 4), (0, 0), "float32")]}
    destination = {key: [aoa.ShardDesc(key, (rows, 4), (rows, 4), (0, 0), "float32")]
                   for key, rows in (("a", 4), ("b", 2))}
    with pytest.raises(aoa.AoaError) as caught:
        aoa.compile(["a, b -> c, axis=0"], source, destination, reverse=True)
    assert caught.value.message == ("destination 'a' is declared with global shape [4, 4], but "
                                    "the program produces [3, 4]")
    assert caught.value.hint == (
        "Run backwards, this concat splits 'c' into 2 equal parts, as Paddle does, so parts "
        "of unequal sizes get no inverse from it. Write the backward mapping by hand: split "
        "into equal parts of a size that divides every part, then join them.")
    wrong = {"c": [aoa.ShardDesc("c", (5, 4), (5, 4), (0, 0), "float32")]}
    with pytest.raises(aoa.AoaError) as caught:  # forwards, the hint is the usual one
        aoa.compile(["a, b -> c, axis=0"], destination, wrong)
    assert caught.value.hint.startswith("Declare the destination with the shape")
