"""Source checkpoint folders and destination writers, read back by safetensors itself."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from aoa.errors import StorageError
from aoa.storage.checkpoint import (
    HfFile,
    RankFile,
    ShardSpec,
    SourceCheckpoint,
    open_source_checkpoint,
    plan_hf_files,
    plan_rank_files,
    write_hf_checkpoint,
    write_hf_files,
    write_hf_index,
    write_sharded_checkpoint,
)
from aoa.storage.safetensors import TensorSpec


def dcp_file(path: Path, chunks: dict[str, tuple[np.ndarray, list[int]]]) -> None:
    """A file as PyTorch DCP's Hugging Face storage writes it: chunks and their offsets."""
    info = {key: {"saved_offsets": offset} for key, (_, offset) in chunks.items()}
    save_file(
        {key: array for key, (array, _) in chunks.items()},
        path,
        metadata={"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0"},
    )


def hf_index(folder: Path, weight_map: dict[str, str]) -> None:
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def assemble(checkpoint: SourceCheckpoint, key: str) -> np.ndarray:
    """The global tensor ``key``, put together from its shards' buffers."""
    shards = checkpoint.shards[key]
    whole = np.zeros(shards[0].global_shape, dtype=np.float32)
    for shard in shards:
        local = np.frombuffer(checkpoint.buffer(shard), np.float32).reshape(shard.local_shape)
        where = tuple(
            slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape, strict=True)
        )
        whole[where] = local
    return whole


def storage_error(call, *args) -> str:
    with pytest.raises(StorageError) as caught:
        call(*args)
    return caught.value.message


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def arange(*shape: int) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


# ---------------------------------------------------------------------------- source side


def test_hugging_face_single_file_folder(tmp_path: Path) -> None:
    arrays = {"w": arange(3, 4), "b": np.arange(4, dtype=np.int64)}
    save_file(arrays, tmp_path / "model.safetensors")
    for path in (tmp_path, tmp_path / "model.safetensors"):
        with open_source_checkpoint(path) as checkpoint:
            assert set(checkpoint.shards) == {"w", "b"}
            [w] = checkpoint.shards["w"]
            assert (w.key, w.dtype, w.local_shape, w.global_shape, w.global_offset) == (
                "w",
                "float32",
                (3, 4),
                (3, 4),
                (0, 0),
            )
            assert (w.file, w.nbytes) == (tmp_path / "model.safetensors", 48)
            assert bytes(checkpoint.buffer(w)) == arrays["w"].tobytes()
            assert checkpoint.shards["b"][0].dtype == "int64"


def test_hugging_face_index_folder(tmp_path: Path) -> None:
    save_file({"a": arange(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": arange(3), "c": arange(1)}, tmp_path / "model-00002-of-00002.safetensors")
    save_file({"stray": arange(1)}, tmp_path / "not-in-the-index.safetensors")
    hf_index(
        tmp_path,
        {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        },
    )
    with open_source_checkpoint(tmp_path) as checkpoint:
        assert list(checkpoint.shards) == ["a", "b", "c"]
        assert checkpoint.shards["b"][0].file == tmp_path / "model-00002-of-00002.safetensors"
        assert bytes(checkpoint.buffer(checkpoint.shards["b"][0])) == arange(3).tobytes()


def test_index_naming_a_missing_shard_file(tmp_path: Path) -> None:
    save_file({"a": arange(2)}, tmp_path / "model-00001-of-00002.safetensors")
    hf_index(
        tmp_path,
        {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    )
    assert storage_error(open_source_checkpoint, tmp_path) == (
        f"{tmp_path / 'model.safetensors.index.json'}: names shard file "
        "'model-00002-of-00002.safetensors', which does not exist"
    )


def test_index_that_disagrees_with_its_files(tmp_path: Path) -> None:
    save_file({"a": arange(2), "x": arange(1)}, tmp_path / "one.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    hf_index(tmp_path, {"a": "one.safetensors", "b": "one.safetensors"})
    assert storage_error(open_source_checkpoint, tmp_path) == (
        f"{index}: says tensor 'b' is in 'one.safetensors', which does not hold it"
    )
    hf_index(tmp_path, {"a": "one.safetensors"})
    assert storage_error(open_source_checkpoint, tmp_path) == (
        f"{tmp_path / 'one.safetensors'}: tensor 'x' is not in the index {index}"
    )
    index.write_text('{"weight_map": []}')
    assert storage_error(open_source_checkpoint, tmp_path) == (
        f"{index}: index has no weight_map object of key -> file name"
    )


def test_dcp_sharded_folder(tmp_path: Path) -> None:
    whole = arange(4, 6)
    dcp_file(
        tmp_path / "shard-0.safetensors",
        {"w": (whole[:2, :4].copy(), [0, 0]), "bias": (arange(3), [0])},
    )
    dcp_file(tmp_path / "shard-1.safetensors", {"w": (whole[:2, 4:].copy(), [0, 4])})
    dcp_file(tmp_path / "shard-2.safetensors", {"w": (whole[2:].copy(), [2, 0])})
    with open_source_checkpoint(tmp_path) as checkpoint:
        shards = checkpoint.shards["w"]
        assert [(s.global_offset, s.local_shape) for s in shards] == [
            ((0, 0), (2, 4)),
            ((0, 4), (2, 2)),
            ((2, 0), (2, 6)),
        ]
        assert {s.global_shape for s in shards} == {(4, 6)}
        assert [s.file.name for s in shards] == [f"shard-{n}.safetensors" for n in range(3)]
        np.testing.assert_array_equal(assemble(checkpoint, "w"), whole)
        assert checkpoint.shards["bias"][0].global_shape == (3,)


def test_dcp_files_listed_by_an_index(tmp_path: Path) -> None:
    dcp_file(tmp_path / "a.safetensors", {"w": (arange(2), [0]), "v": (arange(1), [0])})
    dcp_file(tmp_path / "b.safetensors", {"w": (arange(2) + 2, [2])})
    dcp_file(tmp_path / "ignored.safetensors", {"w": (arange(2), [4])})
    # DCP maps a key split over files to one of them; the index's file list is what counts.
    hf_index(tmp_path, {"w": "b.safetensors", "v": "a.safetensors"})
    with open_source_checkpoint(tmp_path) as checkpoint:
        assert [s.file.name for s in checkpoint.shards["w"]] == ["a.safetensors", "b.safetensors"]
        np.testing.assert_array_equal(assemble(checkpoint, "w"), arange(4))
    # An index that misses a file of chunks is caught by the coverage check, not trusted.
    (tmp_path / "a.safetensors").unlink()
    hf_index(tmp_path, {"w": "b.safetensors"})
    assert storage_error(open_source_checkpoint, tmp_path) == (
        "tensor 'w': its chunks cover 2 of the 4 elements of its global shape [4]; files: "
        f"{tmp_path / 'b.safetensors'}"
    )


def test_same_key_in_two_files_without_sharding_info(tmp_path: Path) -> None:
    save_file({"w": arange(2)}, tmp_path / "a.safetensors")
    save_file({"w": arange(2)}, tmp_path / "b.safetensors")
    assert storage_error(open_source_checkpoint, tmp_path) == (
        "tensor 'w' is stored in several files without DCP_SHARDING_INFO: "
        f"{tmp_path / 'a.safetensors'}, {tmp_path / 'b.safetensors'}"
    )


def test_chunks_of_different_dtypes(tmp_path: Path) -> None:
    dcp_file(tmp_path / "a.safetensors", {"w": (arange(2), [0])})
    dcp_file(tmp_path / "b.safetensors", {"w": (np.zeros(2, np.float16), [2])})
    assert storage_error(open_source_checkpoint, tmp_path) == (
        f"tensor 'w' is float16 [2] in {tmp_path / 'b.safetensors'} but float32 [2] in "
        f"{tmp_path / 'a.safetensors'}"
    )


def test_overlapping_chunks(tmp_path: Path) -> None:
    dcp_file(tmp_path / "a.safetensors", {"w": (arange(2, 3), [0, 0])})
    dcp_file(tmp_path / "b.safetensors", {"w": (arange(2, 3), [1, 2])})
    assert storage_error(open_source_checkpoint, tmp_path) == (
        f"tensor 'w': chunk at [0, 0] in {tmp_path / 'a.safetensors'} overlaps chunk at "
        f"[1, 2] in {tmp_path / 'b.safetensors'}"
    )


def test_overlap_inside_a_grid_of_chunks(tmp_path: Path, monkeypatch) -> None:
    chunks = {f"{i}{j}": ([2 * i, 3 * j], (2, 3)) for i in range(3) for j in range(3)}
    chunks["extra"] = ([3, 4], (1, 1))  # inside chunk "12"
    for name, (offset, shape) in chunks.items():
        dcp_file(tmp_path / f"{name}.safetensors", {"w": (arange(*shape), offset)})
    expected = (
        f"tensor 'w': chunk at [2, 3] in {tmp_path / '11.safetensors'} overlaps chunk at "
        f"[3, 4] in {tmp_path / 'extra.safetensors'}"
    )
    assert storage_error(open_source_checkpoint, tmp_path) == expected
    monkeypatch.setattr("aoa.storage.checkpoint._MAX_GRID_CELLS", 0)  # the pairwise path
    assert storage_error(open_source_checkpoint, tmp_path) == expected
    (tmp_path / "extra.safetensors").unlink()
    with open_source_checkpoint(tmp_path) as checkpoint:
        assert checkpoint.shards["w"][0].global_shape == (6, 9)


def test_scalar_chunks_and_empty_chunks(tmp_path: Path) -> None:
    dcp_file(tmp_path / "a.safetensors", {"s": (np.array(1, np.float32), [])})
    dcp_file(tmp_path / "b.safetensors", {"e": (arange(0, 3), [0, 0])})
    dcp_file(tmp_path / "c.safetensors", {"e": (arange(2, 3), [0, 0])})
    with open_source_checkpoint(tmp_path) as checkpoint:  # an empty chunk overlaps nothing
        assert checkpoint.shards["s"][0].global_shape == ()
        assert [s.local_shape for s in checkpoint.shards["e"]] == [(0, 3), (2, 3)]
    dcp_file(tmp_path / "b.safetensors", {"s": (np.array(2, np.float32), [])})
    with open_source_checkpoint(tmp_path) as checkpoint:  # the same box twice: a replica
        assert len(checkpoint.shards["s"]) == 1
        assert checkpoint.shards["s"][0].file == tmp_path / "a.safetensors"


def test_replicas_count_once_but_partial_overlaps_are_refused(tmp_path: Path) -> None:
    for rank in range(2):  # both ranks saved the replicated tensor whole
        dcp_file(tmp_path / f"{rank}.safetensors", {"w": (arange(2, 2), [0, 0])})
    with open_source_checkpoint(tmp_path) as checkpoint:
        assert [s.file.name for s in checkpoint.shards["w"]] == ["0.safetensors"]
    dcp_file(tmp_path / "2.safetensors", {"w": (arange(1, 2), [1, 0])})
    assert "overlaps chunk" in storage_error(open_source_checkpoint, tmp_path)


def test_chunks_that_leave_a_hole(tmp_path: Path) -> None:
    dcp_file(tmp_path / "a.safetensors", {"w": (arange(2, 2), [0, 0])})
    dcp_file(tmp_path / "b.safetensors", {"w": (arange(2, 2), [2, 2])})
    assert storage_error(open_source_checkpoint, tmp_path) == (
        "tensor 'w': its chunks cover 8 of the 16 elements of its global shape [4, 4]; files: "
        f"{tmp_path / 'a.safetensors'}, {tmp_path / 'b.safetensors'}"
    )


def test_bad_sharding_info(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    cases = [
        ("{", "DCP_SHARDING_INFO is not JSON"),
        ('{"v": {"saved_offsets": [0]}}', "DCP_SHARDING_INFO names tensor 'v', which the file"),
        (
            '{"w": {"saved_offsets": [0]}}',
            "DCP_SHARDING_INFO: tensor 'w' has saved_offsets [0], not 2 non-negative integers",
        ),
    ]
    for info, fragment in cases:
        save_file({"w": arange(2, 2)}, path, metadata={"DCP_SHARDING_INFO": info})
        assert storage_error(open_source_checkpoint, tmp_path).startswith(f"{path}: {fragment}")


def test_folder_without_files_and_missing_path(tmp_path: Path) -> None:
    assert storage_error(open_source_checkpoint, tmp_path) == (
        f"{tmp_path}: no .safetensors files in this folder"
    )
    assert storage_error(open_source_checkpoint, tmp_path / "nope") == (
        f"{tmp_path / 'nope'}: no such checkpoint file or folder"
    )


def test_a_bad_file_names_itself(tmp_path: Path) -> None:
    save_file({"a": arange(2)}, tmp_path / "a.safetensors")
    (tmp_path / "b.safetensors").write_bytes(b"\1\0")
    assert storage_error(open_source_checkpoint, tmp_path).startswith(
        f"{tmp_path / 'b.safetensors'}: truncated"
    )


# ----------------------------------------------------------------------- destination side


def specs(*sizes: int) -> list[TensorSpec]:
    """float32 vectors t0, t1, ... of these element counts (4 bytes each)."""
    return [TensorSpec(f"t{i}", "float32", (n,)) for i, n in enumerate(sizes)]


def fill_arange(name: str, view: memoryview) -> None:
    view[:] = np.arange(len(view) // 4, dtype=np.float32).tobytes()


def test_plan_hf_files() -> None:
    assert plan_hf_files(specs(1, 2), max_file_bytes=100) == [
        HfFile("model.safetensors", specs(1, 2))
    ]
    t = specs(5, 5, 30, 1, 1)  # 20, 20, 120, 4, 4 bytes
    assert plan_hf_files(t, max_file_bytes=40) == [
        HfFile("model-00001-of-00003.safetensors", t[0:2]),
        HfFile("model-00002-of-00003.safetensors", t[2:3]),
        HfFile("model-00003-of-00003.safetensors", t[3:5]),
    ]
    assert plan_hf_files([], max_file_bytes=40) == [HfFile("model.safetensors", [])]
    with pytest.raises(StorageError, match="tensor 't0' appears twice"):
        plan_hf_files([*specs(1), *specs(2)])


def test_write_hf_checkpoint_in_several_files(tmp_path: Path) -> None:
    tensors = [*specs(5, 5, 30, 1), TensorSpec("bf", "bfloat16", (2, 3))]
    out = tmp_path / "out" / "nested"
    written = write_hf_checkpoint(out, tensors, fill_arange, max_file_bytes=40)
    names = [f"model-0000{n}-of-00003.safetensors" for n in (1, 2, 3)]
    assert written == [out / name for name in names] + [out / "model.safetensors.index.json"]
    assert listing(out) == sorted([*names, "model.safetensors.index.json"])

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": 20 + 20 + 120 + 4 + 12}
    assert index["weight_map"] == {
        "t0": names[0],
        "t1": names[0],
        "t2": names[1],
        "t3": names[2],
        "bf": names[2],
    }
    loaded = {k: v for name in names for k, v in load_file(out / name).items()}
    for spec in specs(5, 5, 30, 1):
        assert loaded[spec.name].tobytes() == np.arange(spec.shape[0], dtype=np.float32).tobytes()
    assert loaded["bf"].shape == (2, 3)

    with open_source_checkpoint(out) as checkpoint:
        assert list(checkpoint.shards) == ["t0", "t1", "t2", "t3", "bf"]
        assert checkpoint.shards["bf"][0].dtype == "bfloat16"


def test_write_hf_checkpoint_in_one_file(tmp_path: Path) -> None:
    hf_index(tmp_path, {"old": "model-00001-of-00009.safetensors"})  # from an earlier run
    written = write_hf_checkpoint(tmp_path, specs(3), fill_arange, metadata={"format": "pt"})
    assert written == [tmp_path / "model.safetensors"]
    assert listing(tmp_path) == ["model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", framework="numpy") as file:
        assert file.metadata() == {"format": "pt"}
        assert file.get_tensor("t0").tolist() == [0, 1, 2]


def test_ranks_write_their_own_hf_files(tmp_path: Path) -> None:
    tensors = specs(5, 5, 30, 1, 9)
    plan = plan_hf_files(tensors, max_file_bytes=40)
    together = tmp_path / "together"
    write_hf_checkpoint(together, tensors, fill_arange, max_file_bytes=40)
    apart = tmp_path / "apart"
    for rank in range(2):
        write_hf_files(apart, plan[rank::2], fill_arange)
    write_hf_index(apart, plan)
    assert listing(apart) == listing(together)
    for name in listing(together):
        assert (apart / name).read_bytes() == (together / name).read_bytes()


def test_failing_fill_leaves_no_files(tmp_path: Path) -> None:
    calls: list[str] = []

    def fill(name: str, view: memoryview) -> None:
        calls.append(name)
        if name == "t3":  # in the third file, after two are complete
            raise RuntimeError("copy failed")
        fill_arange(name, view)

    with pytest.raises(RuntimeError, match="copy failed"):
        write_hf_checkpoint(tmp_path / "out", specs(5, 5, 30, 1), fill, max_file_bytes=40)
    assert calls == ["t0", "t1", "t2", "t3"]
    assert listing(tmp_path / "out") == []


def test_failing_rename_removes_the_files_already_in_place(tmp_path: Path) -> None:
    (tmp_path / "model-00002-of-00002.safetensors").mkdir()  # the rename onto it fails
    with pytest.raises(StorageError) as caught:
        write_hf_checkpoint(tmp_path, specs(10, 10), fill_arange, max_file_bytes=40)
    path = tmp_path / "model-00002-of-00002.safetensors"
    assert caught.value.message == f"{path}: cannot write: Is a directory"
    assert listing(tmp_path) == ["model-00002-of-00002.safetensors"]


def test_failing_fill_keeps_an_older_checkpoint(tmp_path: Path) -> None:
    write_hf_checkpoint(tmp_path, specs(3), fill_arange)
    before = (tmp_path / "model.safetensors").read_bytes()

    def fill(name: str, view: memoryview) -> None:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError):
        write_hf_checkpoint(tmp_path, specs(3), fill)
    assert listing(tmp_path) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_output_folder_that_cannot_be_created(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("a file, not a folder")
    out = tmp_path / "plain" / "out"
    message = storage_error(write_hf_checkpoint, out, specs(1), fill_arange)
    assert message.startswith(f"{out}: cannot create the output folder: ")
    ranks = plan_rank_files([[ShardSpec("w", "float32", (1,), (0,))]])
    message = storage_error(write_sharded_checkpoint, out, ranks, lambda *args: None)
    assert message.startswith(f"{out}: cannot create the output folder: ")
    message = storage_error(write_hf_checkpoint, tmp_path / "plain", specs(1), fill_arange)
    assert message.startswith(f"{tmp_path / 'plain'}: cannot create the output folder: ")


def split_rows(whole: np.ndarray, ranks: int) -> list[list[ShardSpec]]:
    """Row blocks of ``whole`` (key 'w') and column blocks of a bias (key 'b') per rank."""
    rows = whole.shape[0] // ranks
    return [
        [
            ShardSpec("w", "float32", (rows, whole.shape[1]), (rank * rows, 0)),
            ShardSpec("b", "float32", (1,), (rank,)),
        ]
        for rank in range(ranks)
    ]


def fill_from(whole: np.ndarray, bias: np.ndarray):
    def fill(filename: str, shard: ShardSpec, view: memoryview) -> None:
        source = whole if shard.key == "w" else bias
        where = tuple(
            slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape, strict=True)
        )
        view[:] = np.ascontiguousarray(source[where]).tobytes()

    return fill


def test_sharded_checkpoint_round_trip(tmp_path: Path) -> None:
    whole, bias = arange(8, 3), arange(4) + 100
    ranks = plan_rank_files(split_rows(whole, 4))
    assert [r.filename for r in ranks] == [f"rank-0000{n}-of-00004.safetensors" for n in range(4)]
    written = write_sharded_checkpoint(tmp_path, ranks, fill_from(whole, bias))
    assert written == [tmp_path / r.filename for r in ranks]

    with safe_open(tmp_path / "rank-00002-of-00004.safetensors", framework="numpy") as file:
        info = json.loads(file.metadata()["DCP_SHARDING_INFO"])
        assert info == {"w": {"saved_offsets": [4, 0]}, "b": {"saved_offsets": [2]}}
        np.testing.assert_array_equal(file.get_tensor("w"), whole[4:6])

    with open_source_checkpoint(tmp_path) as checkpoint:
        assert [s.global_offset for s in checkpoint.shards["w"]] == [(0, 0), (2, 0), (4, 0), (6, 0)]
        assert {s.global_shape for s in checkpoint.shards["w"]} == {(8, 3)}
        np.testing.assert_array_equal(assemble(checkpoint, "w"), whole)
        np.testing.assert_array_equal(assemble(checkpoint, "b"), bias)


def test_ranks_write_their_own_sharded_files(tmp_path: Path) -> None:
    whole, bias = arange(4, 2), arange(2)
    ranks = plan_rank_files(split_rows(whole, 2))
    for rank in ranks:
        write_sharded_checkpoint(tmp_path, [rank], fill_from(whole, bias))
    with open_source_checkpoint(tmp_path) as checkpoint:
        np.testing.assert_array_equal(assemble(checkpoint, "w"), whole)


def test_failing_fill_shard_leaves_no_files(tmp_path: Path) -> None:
    whole, bias = arange(4, 2), arange(2)
    good = fill_from(whole, bias)

    def fill(filename: str, shard: ShardSpec, view: memoryview) -> None:
        if filename.startswith("rank-00001"):
            raise RuntimeError("copy failed")
        good(filename, shard, view)

    with pytest.raises(RuntimeError):
        write_sharded_checkpoint(tmp_path, plan_rank_files(split_rows(whole, 2)), fill)
    assert listing(tmp_path) == []


def test_shard_spec_checks(tmp_path: Path) -> None:
    bad_rank = [RankFile("r.safetensors", [ShardSpec("w", "float32", (2, 2), (0,))])]
    assert storage_error(write_sharded_checkpoint, tmp_path, bad_rank, lambda *a: None) == (
        f"{tmp_path / 'r.safetensors'}: tensor 'w': global offset [0] and local shape [2, 2] "
        "have different numbers of axes"
    )
    twice = [RankFile("r.safetensors", [ShardSpec("w", "float32", (1,), (n,)) for n in (0, 1)])]
    message = storage_error(write_sharded_checkpoint, tmp_path, twice, lambda *a: None)
    assert message.startswith(f"{tmp_path / 'r.safetensors'}: tensor 'w': ")
    assert listing(tmp_path) == []
