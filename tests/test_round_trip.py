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
