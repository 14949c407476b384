"""Reading safetensors folders (Hugging Face, and DCP-sharded), files written by the
`safetensors` package itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from safetensors_files import dcp_file, hf_index
from sharding import assemble

from aoa.errors import StorageError
from aoa.layout import ShardDesc
from aoa.storage import open_source
from aoa.storage.formats import Source


def storage_error(call, *args) -> str:
    with pytest.raises(StorageError) as caught:
        call(*args)
    return caught.value.message


def arange(*shape: int) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)


# ---------------------------------------------------------------------------- source side


def test_hugging_face_single_file_folder(tmp_path: Path) -> None:
    arrays = {"w": arange(3, 4), "b": np.arange(4, dtype=np.int64)}
    save_file(arrays, tmp_path / "model.safetensors")
    for path in (tmp_path, tmp_path / "model.safetensors"):
        with open_source(path) as checkpoint:
            assert set(checkpoint.shards) == {"w", "b"}
            [w] = checkpoint.shards["w"]
            assert (w.key, w.dtype, w.local_shape, w.global_shape, w.global_offset) == (
                "w",
                "float32",
                (3, 4),
                (3, 4),
                (0, 0),
            )
            assert (checkpoint.file_of(w), w.nbytes) == (tmp_path / "model.safetensors", 48)
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
    with open_source(tmp_path) as checkpoint:
        assert list(checkpoint.shards) == ["a", "b", "c"]
        b = checkpoint.shards["b"][0]
        assert checkpoint.file_of(b) == tmp_path / "model-00002-of-00002.safetensors"
        assert bytes(checkpoint.buffer(checkpoint.shards["b"][0])) == arange(3).tobytes()


def _two_files(folder: Path) -> dict[str, np.ndarray]:
    """A folder of two files, "a" and "c" in the first, "b" in the second; their arrays."""
    arrays = {"a": arange(2), "b": arange(3, 5), "c": arange(1)}
    save_file({"a": arrays["a"], "c": arrays["c"]}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": arrays["b"]}, folder / "model-00002-of-00002.safetensors")
    return arrays


def _c_b_a_and_a_stray(checkpoint: Source) -> list[ShardDesc]:
    """The shards of "c", "b" and "a" of `_two_files`, then one of "d", which it lacks."""
    return ([checkpoint.shards[key][0] for key in ("c", "b", "a")]
            + [ShardDesc.full("d", (2,), "float32")])


def test_many_shards_at_once_across_files(tmp_path: Path, monkeypatch) -> None:
    """`buffers` and `release_many` (a fill's shards in one call) read and drop what `buffer`
    and `release` of each do, in the order asked, across files; a shard the source lacks is
    named as `buffer` names it."""
    import aoa.storage.pages as pages

    monkeypatch.setattr(pages, "BATCH_BYTES", 1)  # every release drops its pages at once
    arrays = _two_files(tmp_path)
    hf_index(tmp_path, {"a": "model-00001-of-00002.safetensors",
                        "b": "model-00002-of-00002.safetensors",
                        "c": "model-00001-of-00002.safetensors"})
    with open_source(tmp_path) as checkpoint:
        shards = [checkpoint.shards[key][0] for key in ("c", "b", "a", "b")]
        views = checkpoint.buffers(shards)
        assert [bytes(view) for view in views] == [
            arrays[key].tobytes() for key in ("c", "b", "a", "b")]
        checkpoint.release_many(shards)
        assert [bytes(view) for view in checkpoint.buffers(shards)] == [
            arrays[key].tobytes() for key in ("c", "b", "a", "b")]
        stray = ShardDesc.full("d", (2,), "float32")
        expected = storage_error(checkpoint.buffer, stray)
        assert expected == f"{tmp_path}: holds no shard of 'd' at global offset [0]"
        assert storage_error(checkpoint.buffers, [shards[0], stray]) == expected
        assert storage_error(checkpoint.release_many, [stray]) == expected


def test_plan_indices_read_and_drop_what_shards_do(tmp_path: Path, monkeypatch) -> None:
    """`plan_release` (a plan's shards looked up once, dropped by columns of ranges per file)
    asks each file to drop the ranges `release_many` asks for; `plan_buffers` reads what
    `buffers` reads; a shard the source lacks, or a closed file, is named when asked, as
    `release_many` and `buffers` name them."""
    import aoa.storage.pages as pages

    monkeypatch.setattr(pages, "BATCH_BYTES", 1 << 40)  # keep the ranges pending, to compare
    arrays = _two_files(tmp_path)
    with open_source(tmp_path) as checkpoint:
        shards = _c_b_a_and_a_stray(checkpoint)

        def pending() -> list[list[tuple[int, int]]]:
            found = []
            for file in checkpoint._listed:  # type: ignore[attr-defined]
                ranges = list(file.pages._ranges)
                ranges += [tuple(row) for part in file.pages._columns for row in part.tolist()]
                found.append(sorted(ranges))
                file.pages.flush()
            return found

        checkpoint.release_many(shards[:3])
        expected = pending()
        checkpoint.plan_release(shards)([0, 1, 2])
        assert pending() == expected
        assert [bytes(view) for view in checkpoint.buffers(shards[:3])] == [
            arrays[key].tobytes() for key in ("c", "b", "a")]
        message = storage_error(checkpoint.plan_release(shards), [1, 3])
        assert message == f"{tmp_path}: holds no shard of 'd' at global offset [0]"
        buffers = checkpoint.plan_buffers(shards)
        assert [bytes(view) for view in buffers([2, 1, 0, 1])] == [
            arrays[key].tobytes() for key in ("a", "b", "c", "b")]
        assert storage_error(buffers, [0, 3]) == message
    closed = f"{tmp_path / 'model-00002-of-00002.safetensors'}: closed; cannot read tensor 'b'"
    assert storage_error(buffers, [1, 0]) == closed


def test_plan_windows_are_the_ranges_plan_buffers_read(tmp_path: Path) -> None:
    """`plan_windows` gives each file asked once, in file order, and each shard's range in
    it: the bytes `plan_buffers` reads; a shard the source lacks, or a closed file (the one
    first asked), named as `plan_buffers` names them."""
    arrays = _two_files(tmp_path)
    with open_source(tmp_path) as checkpoint:
        shards = _c_b_a_and_a_stray(checkpoint)
        windows = checkpoint.plan_windows(shards)
        buffers, rows = windows(np.array([1, 2, 0, 1], np.int64))
        assert rows.dtype == np.int64 and rows.shape == (4, 3)
        assert len(buffers) == 2 and rows[:, 0].tolist() == [1, 0, 0, 1]
        assert [bytes(buffers[b][o:o + n]) for b, o, n in rows.tolist()] == [
            arrays[key].tobytes() for key in ("b", "a", "c", "b")]
        message = storage_error(windows, np.array([0, 3], np.int64))
        assert message == f"{tmp_path}: holds no shard of 'd' at global offset [0]"
    closed = f"{tmp_path / 'model-00002-of-00002.safetensors'}: closed; cannot read tensor 'b'"
    assert storage_error(windows, np.array([1, 0], np.int64)) == closed


def test_the_shards_as_made_are_located_as_copies_of_them_are_looked_up(
        tmp_path: Path) -> None:
    """A plan asking for every shard the reader made, in its order (the very objects), is
    given their locations without a look-up; the same shards as copies, or in another
    order, are looked up: the rows, buffers and windows are the same either way."""
    folder = tmp_path / "ranks"
    folder.mkdir()
    full = {"w": arange(4, 3), "v": arange(2, 2)}
    for rank in range(2):
        dcp_file(folder / f"rank-{rank:05d}-of-00002.safetensors",
                 {"w": (full["w"][2 * rank:2 * rank + 2], [2 * rank, 0]),
                  "v": (full["v"], [0, 0])})  # v replicated on both ranks
    with open_source(folder) as checkpoint:
        made = [shard for shards in checkpoint.shards.values() for shard in shards]
        assert checkpoint.made_locations(made) is not None
        copies = [ShardDesc(s.key, s.local_shape, s.global_shape, s.global_offset, s.dtype)
                  for s in made]
        assert checkpoint.made_locations(copies) is None
        assert checkpoint.made_locations(made[::-1]) is None
        assert [(s.key, s.global_offset) for s in made] == [("v", (0, 0)), ("w", (0, 0)),
                                                            ("w", (2, 0))]
        assert checkpoint.locations(made) == checkpoint.locations(copies) == [0, 1, 3]
        everything = np.arange(len(made))
        assert (checkpoint.plan_windows(made)(everything)[1].tolist()
                == checkpoint.plan_windows(copies)(everything)[1].tolist())
        assert [bytes(view) for view in checkpoint.plan_buffers(made)([0, 1, 2])] == [
            full["v"].tobytes(), full["w"][:2].tobytes(), full["w"][2:].tobytes()]


def test_a_closed_source_names_the_file_and_the_tensor_asked(tmp_path: Path) -> None:
    save_file({"a": arange(2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": arange(3)}, tmp_path / "model-00002-of-00002.safetensors")
    checkpoint = open_source(tmp_path)
    shards = [checkpoint.shards["b"][0], checkpoint.shards["a"][0]]
    checkpoint.close()
    expected = f"{tmp_path / 'model-00002-of-00002.safetensors'}: closed; cannot read tensor 'b'"
    assert storage_error(checkpoint.buffers, shards) == expected
    assert storage_error(checkpoint.buffer, shards[0]) == expected


def test_index_naming_a_missing_shard_file(tmp_path: Path) -> None:
    save_file({"a": arange(2)}, tmp_path / "model-00001-of-00002.safetensors")
    hf_index(
        tmp_path,
        {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    )
    assert storage_error(open_source, tmp_path) == (
        f"{tmp_path / 'model.safetensors.index.json'}: names shard file "
        "'model-00002-of-00002.safetensors', which does not exist"
    )


def test_index_that_disagrees_with_its_files(tmp_path: Path) -> None:
    save_file({"a": arange(2), "x": arange(1)}, tmp_path / "one.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    hf_index(tmp_path, {"a": "one.safetensors", "b": "one.safetensors"})
    assert storage_error(open_source, tmp_path) == (
        f"{index}: says tensor 'b' is in 'one.safetensors', which does not hold it"
    )
    hf_index(tmp_path, {"a": "one.safetensors"})
    assert storage_error(open_source, tmp_path) == (
        f"{tmp_path / 'one.safetensors'}: tensor 'x' is not in the index {index}"
    )
    index.write_text('{"weight_map": []}')
    assert storage_error(open_source, tmp_path) == (
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
    with open_source(tmp_path) as checkpoint:
        shards = checkpoint.shards["w"]
        assert [(s.global_offset, s.local_shape) for s in shards] == [
            ((0, 0), (2, 4)),
            ((0, 4), (2, 2)),
            ((2, 0), (2, 6)),
        ]
        assert {s.global_shape for s in shards} == {(4, 6)}
        assert [checkpoint.file_of(s).name for s in shards] == [
            f"shard-{n}.safetensors" for n in range(3)]
        np.testing.assert_array_equal(assemble(checkpoint, "w"), whole)
        assert checkpoint.shards["bias"][0].global_shape == (3,)


def test_dcp_files_listed_by_an_index(tmp_path: Path) -> None:
    dcp_file(tmp_path / "a.safetensors", {"w": (arange(2), [0]), "v": (arange(1), [0])})
    dcp_file(tmp_path / "b.safetensors", {"w": (arange(2) + 2, [2])})
    dcp_file(tmp_path / "ignored.safetensors", {"w": (arange(2), [4])})
    # DCP maps a key split over files to one of them; the index's file list is what counts.
    hf_index(tmp_path, {"w": "b.safetensors", "v": "a.safetensors"})
    with open_source(tmp_path) as checkpoint:
        assert [checkpoint.file_of(s).name for s in checkpoint.shards["w"]] == [
            "a.safetensors", "b.safetensors"]
        np.testing.assert_array_equal(assemble(checkpoint, "w"), arange(4))
    # An index that misses a file of chunks is caught by the coverage check, not trusted.
    (tmp_path / "a.safetensors").unlink()
    hf_index(tmp_path, {"w": "b.safetensors"})
    assert storage_error(open_source, tmp_path) == (
        "tensor 'w': its chunks cover 2 of the 4 elements of its global shape [4]; files: "
        f"{tmp_path / 'b.safetensors'}"
    )


def test_same_key_in_two_files_without_sharding_info(tmp_path: Path) -> None:
    save_file({"w": arange(2)}, tmp_path / "a.safetensors")
    save_file({"w": arange(2)}, tmp_path / "b.safetensors")
    assert storage_error(open_source, tmp_path) == (
        "tensor 'w' is stored in several files without DCP_SHARDING_INFO: "
        f"{tmp_path / 'a.safetensors'}, {tmp_path / 'b.safetensors'}"
    )


def test_chunks_of_different_dtypes(tmp_path: Path) -> None:
    dcp_file(tmp_path / "a.safetensors", {"w": (arange(2), [0])})
    dcp_file(tmp_path / "b.safetensors", {"w": (np.zeros(2, np.float16), [2])})
    assert storage_error(open_source, tmp_path) == (
        f"tensor 'w' is float16 [2] in {tmp_path / 'b.safetensors'} but float32 [2] in "
        f"{tmp_path / 'a.safetensors'}"
    )


def test_overlapping_chunks(tmp_path: Path) -> None:
    dcp_file(tmp_path / "a.safetensors", {"w": (arange(2, 3), [0, 0])})
    dcp_file(tmp_path / "b.safetensors", {"w": (arange(2, 3), [1, 2])})
    assert storage_error(open_source, tmp_path) == (
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
    assert storage_error(open_source, tmp_path) == expected
    monkeypatch.setattr("aoa.layout._MAX_GRID_CELLS", 0)  # the pairwise path
    assert storage_error(open_source, tmp_path) == expected
    (tmp_path / "extra.safetensors").unlink()
    with open_source(tmp_path) as checkpoint:
        assert checkpoint.shards["w"][0].global_shape == (6, 9)


def test_scalar_chunks_and_empty_chunks(tmp_path: Path) -> None:
    dcp_file(tmp_path / "a.safetensors", {"s": (np.array(1, np.float32), [])})
    dcp_file(tmp_path / "b.safetensors", {"e": (arange(0, 3), [0, 0])})
    dcp_file(tmp_path / "c.safetensors", {"e": (arange(2, 3), [0, 0])})
    with open_source(tmp_path) as checkpoint:  # an empty chunk overlaps nothing
        assert checkpoint.shards["s"][0].global_shape == ()
        # nor holds anything to read: of a tensor that holds elements, it is no shard (it
        # lies at the offset of the chunk that holds them, by which a shard is found)
        (shard,) = checkpoint.shards["e"]
        assert shard.local_shape == (2, 3)
        assert bytes(checkpoint.buffer(shard)) == arange(2, 3).tobytes()
    dcp_file(tmp_path / "b.safetensors", {"s": (np.array(2, np.float32), [])})
    with open_source(tmp_path) as checkpoint:  # the same box twice: a replica
        assert len(checkpoint.shards["s"]) == 1
        assert checkpoint.file_of(checkpoint.shards["s"][0]) == tmp_path / "a.safetensors"


def test_replicas_count_once_but_partial_overlaps_are_refused(tmp_path: Path) -> None:
    for rank in range(2):  # both ranks saved the replicated tensor whole
        dcp_file(tmp_path / f"{rank}.safetensors", {"w": (arange(2, 2), [0, 0])})
    with open_source(tmp_path) as checkpoint:
        assert [checkpoint.file_of(s).name for s in checkpoint.shards["w"]] == ["0.safetensors"]
    dcp_file(tmp_path / "2.safetensors", {"w": (arange(1, 2), [1, 0])})
    assert "overlaps chunk" in storage_error(open_source, tmp_path)


def test_chunks_that_leave_a_hole(tmp_path: Path) -> None:
    dcp_file(tmp_path / "a.safetensors", {"w": (arange(2, 2), [0, 0])})
    dcp_file(tmp_path / "b.safetensors", {"w": (arange(2, 2), [2, 2])})
    assert storage_error(open_source, tmp_path) == (
        "tensor 'w': its chunks cover 8 of the 16 elements of its global shape [4, 4]; files: "
        f"{tmp_path / 'a.safetensors'}, {tmp_path / 'b.safetensors'}"
    )


@pytest.mark.parametrize(("info", "fragment"), [
    ("{", "DCP_SHARDING_INFO:1:2: not valid JSON: Expecting property name"),
    ('{"v": {"saved_offsets": [0]}}', "DCP_SHARDING_INFO names tensor 'v', which the file"),
    ('{"w": {"saved_offsets": [0]}}',
     "DCP_SHARDING_INFO: tensor 'w' has saved_offsets [0], not 2 non-negative integers"),
])
def test_bad_sharding_info(tmp_path: Path, info: str, fragment: str) -> None:
    path = tmp_path / "a.safetensors"
    save_file({"w": arange(2, 2)}, path, metadata={"DCP_SHARDING_INFO": info})
    assert storage_error(open_source, tmp_path).startswith(f"{path}: {fragment}")


def test_folder_without_files_and_missing_path(tmp_path: Path) -> None:
    assert storage_error(open_source, tmp_path) == (
        f"{tmp_path}: no .safetensors files in this folder"
    )
    assert storage_error(open_source, tmp_path / "nope") == (
        f"{tmp_path / 'nope'}: no such checkpoint file or folder"
    )


def test_a_bad_file_names_itself(tmp_path: Path) -> None:
    save_file({"a": arange(2)}, tmp_path / "a.safetensors")
    (tmp_path / "b.safetensors").write_bytes(b"\1\0")
    assert storage_error(open_source, tmp_path).startswith(
        f"{tmp_path / 'b.safetensors'}: truncated"
    )


# ------------------------------------------------------------------ incomplete numbered sets


def test_a_numbered_set_missing_a_file_is_refused(tmp_path: Path) -> None:
    save_file({"a": arange(2)}, tmp_path / "model-00001-of-00003.safetensors")
    save_file({"c": arange(2)}, tmp_path / "model-00003-of-00003.safetensors")
    with pytest.raises(StorageError) as caught:
        open_source(tmp_path)
    assert caught.value.message == (
        f"{tmp_path}: holds 2 of the 3 files model-*-of-00003.safetensors; missing "
        "model-00002-of-00003.safetensors")
    assert caught.value.hint is not None and "did not finish" in caught.value.hint


def test_one_rank_file_of_two_is_refused(tmp_path: Path) -> None:
    """A conversion killed between its renames: rank 0's half of each tensor would read back
    as a whole tensor of half the shape."""
    dcp_file(tmp_path / "rank-00000-of-00002.safetensors", {"w": (arange(2, 3), [0, 0])})
    message = storage_error(open_source, tmp_path)
    assert message == (f"{tmp_path}: holds 1 of the 2 files rank-*-of-00002.safetensors; "
                       "missing rank-00001-of-00002.safetensors")
    alone = tmp_path / "rank-00000-of-00002.safetensors"
    with pytest.raises(StorageError) as caught:
        open_source(alone)
    assert caught.value.message == (f"{alone}: one of the 2 rank files of a sharded checkpoint; "
                                    "its chunks alone do not make the tensors")
    assert caught.value.hint == f"Give the folder: --source {tmp_path}"


def test_whole_numbered_sets_read(tmp_path: Path) -> None:
    for rank in range(2):
        dcp_file(tmp_path / f"rank-{rank:05d}-of-00002.safetensors",
                 {"w": (arange(2, 3) + 6 * rank, [2 * rank, 0])})
    with open_source(tmp_path) as checkpoint:
        np.testing.assert_array_equal(assemble(checkpoint, "w"), arange(4, 3))
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a": arange(2)}, hf / "model-00001-of-00002.safetensors")
    save_file({"b": arange(2)}, hf / "model-00002-of-00002.safetensors")
    with open_source(hf) as checkpoint:  # no index: every file of the set
        assert sorted(checkpoint.shards) == ["a", "b"]
