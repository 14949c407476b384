"""The Paddle drop-in leaves Python's collector as it found it."""

from __future__ import annotations

import gc

from aoa.compat.paddle import AOAEngine, ShardedWeightDesc


def _engine() -> AOAEngine:
    source = {"w": [ShardedWeightDesc("w", (2, 4), (2, 4), (0, 0), "float32")]}
    destination = {"v": [ShardedWeightDesc("v", (4, 1), (4, 2), (0, 0), "float32"),
                         ShardedWeightDesc("v", (4, 1), (4, 2), (0, 1), "float32")]}
    return AOAEngine({"aoa_statements": ["w^T -> v"]}, source, destination)


def test_the_engine_leaves_the_collector_running_and_nothing_frozen():
    assert gc.isenabled()
    engine = _engine()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    query = ShardedWeightDesc("v", (4, 1), (4, 2), (0, 1), "float32")
    (entry,) = engine.find_shard_sources(query)
    assert entry.source_slice == ShardedWeightDesc("w", (1, 4), (2, 4), (1, 0), "float32")
    assert entry.postprocess_list == ["[1, 0]"]


def test_objects_frozen_before_stay_frozen():
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        _engine()
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
    assert frozen > frozen_before
