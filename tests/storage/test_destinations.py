"""The safetensors and dcp-safetensors destinations, written through the storage interface
and read back by the `safetensors` package and by aoa's reader."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file
from sharding import assemble, sharded

from aoa.errors import StorageError, UsageError
from aoa.layout import ShardDesc
from aoa.storage import Destination, OutputFile, Piece, open_source
from aoa.storage.dcp_safetensors import DcpSafetensorsDestination
from aoa.storage.folder import Sharing
from aoa.storage.huggingface import HuggingFaceDestination

FillShard = Callable[[ShardDesc, memoryview], None]


def storage_error(call, *args) -> str:
    with pytest.raises(StorageError) as caught:
        call(*args)
    return caught.value.message


def arange(*shape: int) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def vectors(*sizes: int) -> list[ShardDesc]:
    """Whole float32 vectors t0, t1, ... of these element counts (4 bytes each)."""
    return [ShardDesc.full(f"t{i}", (n,), "float32") for i, n in enumerate(sizes)]


def fill_arange(shard: ShardDesc, view: memoryview) -> None:
    view[:] = np.arange(len(view) // 4, dtype=np.float32).tobytes()


def filler(shards: Sequence[ShardDesc], fill_shard: FillShard):
    """A Fill that hands each piece's shard and buffer to ``fill_shard``."""
    def fill(pieces: Sequence[Piece]) -> None:
        for piece in pieces:
            assert piece.elements is None
            fill_shard(shards[piece.shard], piece.buffer)  # type: ignore[arg-type]
    return fill


def write_hf(folder: Path, shards: list[ShardDesc], fill_shard: FillShard,
             max_file_bytes: int | None = None) -> list[Path]:
    """Plan the files, write them all, commit (the index)."""
    files = HuggingFaceDestination.plan_files(shards, None, max_file_bytes=max_file_bytes)
    destination = HuggingFaceDestination(folder, shards, files)
    return destination.write(filler(shards, fill_shard)) + destination.commit()


def test_plan_hugging_face_files() -> None:
    plan = HuggingFaceDestination.plan_files
    assert plan(vectors(1, 2), None, max_file_bytes=100) == [
        OutputFile("model.safetensors", (0, 1), 12)]
    t = vectors(5, 5, 30, 1, 1)  # 20, 20, 120, 4, 4 bytes
    assert plan(t, None, max_file_bytes=40) == [
        OutputFile("model-00001-of-00003.safetensors", (0, 1), 40),
        OutputFile("model-00002-of-00003.safetensors", (2,), 120),
        OutputFile("model-00003-of-00003.safetensors", (3, 4), 8),
    ]
    assert plan([], None) == [OutputFile("model.safetensors", (), 0)]
    with pytest.raises(StorageError, match="tensor 't0' appears twice"):
        plan([*vectors(1), *vectors(2)], None)


@pytest.mark.parametrize(("shards", "ranks", "message"), [
    (vectors(1), [[0]], "the safetensors format (Hugging Face) holds whole tensors, not one "
                        "file per rank"),
    ([ShardDesc("w", (1,), (2,), (1,), "float32")], None,
     "the safetensors format (Hugging Face) holds whole tensors, but 'w' is a shard of [2]"),
])
def test_hugging_face_refuses_shards(shards, ranks, message) -> None:
    with pytest.raises(UsageError) as caught:
        HuggingFaceDestination.plan_files(shards, ranks)
    assert caught.value.message == message


def test_hugging_face_checkpoint_in_several_files(tmp_path: Path) -> None:
    tensors = [*vectors(5, 5, 30, 1), ShardDesc.full("bf", (2, 3), "bfloat16")]
    out = tmp_path / "out" / "nested"
    written = write_hf(out, tensors, fill_arange, max_file_bytes=40)
    names = [f"model-0000{n}-of-00003.safetensors" for n in (1, 2, 3)]
    assert written == [out / name for name in names] + [out / "model.safetensors.index.json"]
    assert listing(out) == sorted([*names, "model.safetensors.index.json"])

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 20 + 20 + 120 + 4 + 12}
    assert index["weight_map"] == {
        "t0": names[0], "t1": names[0], "t2": names[1], "t3": names[2], "bf": names[2]}
    loaded = {k: v for name in names for k, v in load_file(out / name).items()}
    for spec in vectors(5, 5, 30, 1):
        assert loaded[spec.key].tobytes() == np.arange(spec.local_shape[0],
                                                       dtype=np.float32).tobytes()
    assert loaded["bf"].shape == (2, 3)

    with open_source(out) as checkpoint:
        assert checkpoint.format == "safetensors"
        assert list(checkpoint.shards) == ["t0", "t1", "t2", "t3", "bf"]
        assert checkpoint.shards["bf"][0].dtype == "bfloat16"


def test_hugging_face_checkpoint_in_one_file(tmp_path: Path) -> None:
    written = write_hf(tmp_path, vectors(3), fill_arange)
    assert written == [tmp_path / "model.safetensors"]
    assert listing(tmp_path) == ["model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as file:
        assert file.get_tensor("t0").tolist() == [0, 1, 2]


def write_as_rank(destination: Destination, rank: int, world_size: int,
                  files: Sequence[OutputFile], fill_shard: FillShard) -> None:
    """Rank ``rank`` of a conversion writing ``files``; rank 0 last, publishing them all."""
    with destination:
        destination.check(Sharing("conversion", rank, world_size))
        destination.write(filler(destination.shards, fill_shard), files)
        if rank == 0:
            destination.commit()
        else:
            destination.output.mark_done()


def test_ranks_write_their_own_hugging_face_files(tmp_path: Path) -> None:
    tensors = vectors(5, 5, 30, 1, 9)
    together = tmp_path / "together"
    write_hf(together, tensors, fill_arange, max_file_bytes=40)
    apart = tmp_path / "apart"
    files = HuggingFaceDestination.plan_files(tensors, None, max_file_bytes=40)
    for rank in (1, 0):
        write_as_rank(HuggingFaceDestination(apart, tensors, files), rank, 2, files[rank::2],
                      fill_arange)
        if rank == 1:  # staged, and nothing visible yet
            assert listing(apart) == [".aoa-lock", ".aoa-staging"]
    assert listing(apart) == listing(together)
    for name in listing(together):
        assert (apart / name).read_bytes() == (together / name).read_bytes()


def test_failing_fill_leaves_nothing(tmp_path: Path) -> None:
    calls: list[str] = []

    def fill(shard: ShardDesc, view: memoryview) -> None:
        calls.append(shard.key)
        if shard.key == "t3":  # in the third file, after two are complete
            raise RuntimeError("copy failed")
        fill_arange(shard, view)

    with pytest.raises(RuntimeError, match="copy failed"):
        write_hf(tmp_path / "out" / "nested", vectors(5, 5, 30, 1), fill, max_file_bytes=40)
    assert calls == ["t0", "t1", "t2", "t3"]
    assert listing(tmp_path) == []  # the folders it made are gone too


def test_failing_publish_moves_back_what_it_moved(tmp_path: Path) -> None:
    shards = vectors(10, 10)
    files = HuggingFaceDestination.plan_files(shards, None, max_file_bytes=40)
    destination = HuggingFaceDestination(tmp_path, shards, files)
    destination.write(filler(shards, fill_arange))
    (tmp_path / "model-00002-of-00002.safetensors").mkdir()  # the rename onto it fails
    with pytest.raises(StorageError) as caught:
        destination.commit()
    path = tmp_path / "model-00002-of-00002.safetensors"
    assert caught.value.message == f"{path}: cannot publish: Is a directory"
    assert listing(tmp_path) == ["model-00002-of-00002.safetensors"]


def test_a_folder_holding_a_checkpoint_is_left_alone(tmp_path: Path) -> None:
    write_hf(tmp_path, vectors(3), fill_arange)
    before = (tmp_path / "model.safetensors").read_bytes()
    message = storage_error(write_hf, tmp_path, vectors(3), fill_arange)
    assert message == (f"{tmp_path}: the output folder already holds a checkpoint "
                       "(model.safetensors)")
    assert listing(tmp_path) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == before


def split_rows(whole: np.ndarray, ranks: int) -> tuple[list[ShardDesc], list[list[int]]]:
    """Row blocks of ``whole`` (key 'w') and of a bias of one element per rank (key 'b'),
    rank by rank; and each rank's shards as positions."""
    weights, biases = sharded("w", whole.shape, ranks, 0), sharded("b", (ranks,), ranks, 0)
    shards = [shard for pair in zip(weights, biases) for shard in pair]
    return shards, [[2 * rank, 2 * rank + 1] for rank in range(ranks)]


def fill_from(whole: np.ndarray, bias: np.ndarray) -> FillShard:
    def fill(shard: ShardDesc, view: memoryview) -> None:
        source = whole if shard.key == "w" else bias
        where = tuple(
            slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape, strict=True)
        )
        view[:] = np.ascontiguousarray(source[where]).tobytes()

    return fill


def write_ranks(folder: Path, shards: list[ShardDesc], ranks: list[list[int]],
                fill_shard: FillShard, which: slice = slice(None)) -> list[Path]:
    files = DcpSafetensorsDestination.plan_files(shards, ranks)
    destination = DcpSafetensorsDestination(folder, shards, files)
    return destination.write(filler(shards, fill_shard), files[which]) + destination.commit()


def test_sharded_checkpoint_round_trip(tmp_path: Path) -> None:
    whole, bias = arange(8, 3), arange(4) + 100
    shards, ranks = split_rows(whole, 4)
    files = DcpSafetensorsDestination.plan_files(shards, ranks)
    assert [f.filename for f in files] == [f"rank-0000{n}-of-00004.safetensors"
                                           for n in range(4)]
    written = write_ranks(tmp_path, shards, ranks, fill_from(whole, bias))
    assert written == [tmp_path / f.filename for f in files]

    with safe_open(tmp_path / "rank-00002-of-00004.safetensors", framework="numpy") as file:
        info = json.loads(file.metadata()["DCP_SHARDING_INFO"])
        assert info == {"w": {"saved_offsets": [4, 0]}, "b": {"saved_offsets": [2]}}
        np.testing.assert_array_equal(file.get_tensor("w"), whole[4:6])

    with open_source(tmp_path) as checkpoint:
        assert checkpoint.format == "dcp-safetensors"
        assert [s.global_offset for s in checkpoint.shards["w"]] == [(0, 0), (2, 0), (4, 0),
                                                                      (6, 0)]
        assert {s.global_shape for s in checkpoint.shards["w"]} == {(8, 3)}
        np.testing.assert_array_equal(assemble(checkpoint, "w"), whole)
        np.testing.assert_array_equal(assemble(checkpoint, "b"), bias)


def test_ranks_write_their_own_sharded_files(tmp_path: Path) -> None:
    whole, bias = arange(4, 2), arange(2)
    shards, ranks = split_rows(whole, 2)
    files = DcpSafetensorsDestination.plan_files(shards, ranks)
    for rank in (1, 0):
        write_as_rank(DcpSafetensorsDestination(tmp_path, shards, files), rank, 2,
                      files[rank:rank + 1], fill_from(whole, bias))
    assert listing(tmp_path) == [f.filename for f in files]
    with open_source(tmp_path) as checkpoint:
        np.testing.assert_array_equal(assemble(checkpoint, "w"), whole)


def test_failing_fill_shard_leaves_no_files(tmp_path: Path) -> None:
    whole, bias = arange(4, 2), arange(2)
    shards, ranks = split_rows(whole, 2)
    good = fill_from(whole, bias)

    def fill(shard: ShardDesc, view: memoryview) -> None:
        if shard.global_offset[0] > 0:  # rank 1's shards
            raise RuntimeError("copy failed")
        good(shard, view)

    with pytest.raises(RuntimeError):
        write_ranks(tmp_path, shards, ranks, fill)
    assert listing(tmp_path) == []


def test_one_rank_holds_every_shard_without_ranks(tmp_path: Path) -> None:
    shards = [ShardDesc("w", (2,), (4,), (2,), "float32")]
    files = DcpSafetensorsDestination.plan_files(shards, None)
    assert files == [OutputFile("rank-00000-of-00001.safetensors", (0,), 8)]


def test_two_shards_of_a_key_in_one_rank_file(tmp_path: Path) -> None:
    twice = [ShardDesc("w", (1,), (2,), (n,), "float32") for n in (0, 1)]
    message = storage_error(write_ranks, tmp_path, twice, [[0, 1]], fill_arange)
    assert message.startswith(f"{tmp_path / 'rank-00000-of-00001.safetensors'}: tensor 'w': ")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("destination", [HuggingFaceDestination, DcpSafetensorsDestination])
def test_output_folder_that_cannot_be_created(tmp_path: Path, destination) -> None:
    (tmp_path / "plain").write_text("a file, not a folder")
    shards = vectors(1)
    for out in (tmp_path / "plain" / "out", tmp_path / "plain"):
        files = destination.plan_files(shards, None)
        message = storage_error(destination(out, shards, files).write, filler(shards,
                                                                              fill_arange))
        assert message.startswith(f"{out}: cannot create the output folder: ")
