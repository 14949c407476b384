"""Stacked keys: per-layer and per-expert keys translated to the stacked tensors Megatron's
distributed checkpoint stores and back, bytes untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from aoa.errors import StorageError
from aoa.layout import ShardDesc
from aoa.storage.formats import Source
from aoa.storage.stacked import Stacking, UnstackedSource, stack_shards

LAYERS = Stacking("decoder.layers.$LAYER_ID.*", "decoder.layers.*", (3,))
EXPERTS = Stacking("decoder.layers.$LAYER_ID.mlp.experts.*.weight$EXPERT_ID",
                   "decoder.layers.mlp.experts.experts.*.weight", (3, 4))
PER_LAYER_EXPERTS = Stacking("decoder.layers.$LAYER_ID.mlp.experts.local_experts.$EXPERT_ID.*",
                             "decoder.layers.$LAYER_ID.mlp.experts.experts.*", (4,))
RULES = (EXPERTS, LAYERS)


def test_keys_stack_onto_leading_axes_in_placeholder_order():
    shards = [ShardDesc("decoder.layers.2.mlp.experts.linear_fc1.weight3", (4, 5), (8, 5),
                        (4, 0), "bfloat16"),
              ShardDesc("decoder.layers.1.self_attention.linear_qkv.weight", (6, 5), (6, 5),
                        (0, 0)),
              ShardDesc("embedding.word_embeddings.weight", (7, 5), (7, 5), (0, 0))]
    assert stack_shards(shards, RULES) == [
        ShardDesc("decoder.layers.mlp.experts.experts.linear_fc1.weight", (1, 1, 4, 5),
                  (3, 4, 8, 5), (2, 3, 4, 0), "bfloat16"),
        ShardDesc("decoder.layers.self_attention.linear_qkv.weight", (1, 6, 5), (3, 6, 5),
                  (1, 0, 0)),
        ShardDesc("embedding.word_embeddings.weight", (7, 5), (7, 5), (0, 0))]


def test_a_carried_placeholder_stays_in_the_key():
    shard = ShardDesc("decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight",
                      (5, 3), (5, 3), (0, 0))
    assert stack_shards([shard], [PER_LAYER_EXPERTS]) == [
        ShardDesc("decoder.layers.1.mlp.experts.experts.linear_fc2.weight", (1, 5, 3),
                  (4, 5, 3), (2, 0, 0))]


def test_an_index_past_the_stacked_size_is_refused():
    shard = ShardDesc("decoder.layers.3.norm", (2,), (2,), (0,))
    with pytest.raises(StorageError) as caught:
        stack_shards([shard], [LAYERS])
    assert caught.value.message == ("'decoder.layers.3.norm': $LAYER_ID 3 is past the 3 the "
                                    "stacked key 'decoder.layers.*' holds")


def test_keys_of_one_stacked_tensor_must_agree():
    shards = [ShardDesc("decoder.layers.0.norm", (2,), (2,), (0,)),
              ShardDesc("decoder.layers.1.norm", (3,), (3,), (0,))]
    with pytest.raises(StorageError) as caught:
        stack_shards(shards, [LAYERS])
    assert caught.value.message == (
        "'decoder.layers.1.norm' (None [3]) and 'decoder.layers.0.norm' (None [2]) differ, "
        "so they cannot be stacked into 'decoder.layers.norm'")


@pytest.mark.parametrize("each, stacked", [
    ("a.$LAYER_ID.*", "a.$EXPERT_ID.*"),
    ("a.$LAYER_ID.*", "a.x"),
])
def test_bad_rules(each, stacked):
    with pytest.raises(ValueError):
        Stacking(each, stacked, (2,))


class ArraySource(Source[np.ndarray]):
    """Stored chunks held as numpy arrays."""

    def __init__(self, chunks: dict[str, list[tuple[ShardDesc, np.ndarray]]]) -> None:
        super().__init__(Path("mem"), "test", chunks)

    def buffer(self, shard: ShardDesc) -> memoryview:
        return memoryview(self.location(shard)).cast("B")

    def file_of(self, shard: ShardDesc):
        return self.path

    def files(self):
        return []


def test_a_stored_chunk_of_several_layers_and_experts_shows_as_each_index():
    """A chunk spanning layers 1-2 and experts 0-3 of a stacked tensor: each (layer,
    expert) is its own key whose bytes are that slice of the chunk."""
    whole = np.arange(3 * 4 * 2 * 5, dtype=np.float32).reshape(3, 4, 2, 5)
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    chunks = [(ShardDesc(key, (1, 4, 2, 5), (3, 4, 2, 5), (0, 0, 0, 0), "float32"),
               np.ascontiguousarray(whole[:1])),
              (ShardDesc(key, (2, 4, 2, 5), (3, 4, 2, 5), (1, 0, 0, 0), "float32"),
               np.ascontiguousarray(whole[1:]))]
    source = UnstackedSource(ArraySource({key: chunks}), RULES)
    assert len(source.shards) == 12
    for layer in range(3):
        for expert in range(4):
            name = f"decoder.layers.{layer}.mlp.experts.linear_fc1.weight{expert}"
            [shard] = source.shards[name]
            assert shard == ShardDesc(name, (2, 5), (2, 5), (0, 0), "float32")
            assert bytes(source.buffer(shard)) == whole[layer, expert].tobytes()


def test_a_stacked_tensor_of_another_size_is_refused():
    key = "decoder.layers.norm"
    chunk = (ShardDesc(key, (2, 4), (2, 4), (0, 0), "float32"), np.zeros((2, 4), np.float32))
    with pytest.raises(StorageError) as caught:
        UnstackedSource(ArraySource({key: [chunk]}), [LAYERS])
    assert caught.value.message == ("mem: 'decoder.layers.norm' holds [2] on its stacked "
                                    "axes, not the [3] its stacking says")
