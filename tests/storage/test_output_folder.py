"""The output folder's lock and staging (`aoa.storage.folder`): one conversion at a time,
ranks of one conversion together, nothing visible until published, nothing left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aoa.errors import StorageError
from aoa.storage.folder import LOCK_NAME, STAGING_NAME, OutputFolder, Sharing
from aoa.storage.formats import checkpoint_patterns


def folder(path: Path) -> OutputFolder:
    return OutputFolder(path, checkpoint_patterns())


def refusal(output: OutputFolder, sharing: Sharing | None = None) -> str:
    with pytest.raises(StorageError) as caught:
        output.open(sharing)
    return caught.value.message


def stage(output: OutputFolder, name: str, data: bytes = b"data") -> None:
    output.stage(name).write_bytes(data)


def test_one_process_at_a_time(tmp_path: Path) -> None:
    first, second = folder(tmp_path / "out"), folder(tmp_path / "out")
    first.open()
    assert refusal(second).startswith(
        f"{tmp_path / 'out'}: another aoa convert is writing into this folder (process "
        f"{os.getpid()}, since ")
    assert refusal(second, Sharing("x", 0, 2)).startswith(f"{tmp_path / 'out'}: another aoa")
    first.release()  # wrote nothing: the folder it made goes too
    assert not (tmp_path / "out").exists()
    second.open()
    second.release()


def test_ranks_of_one_conversion_share_the_folder(tmp_path: Path) -> None:
    ranks = [folder(tmp_path) for _ in range(3)]
    ranks[0].open(Sharing("a", 0, 2))
    ranks[1].open(Sharing("a", 1, 2))
    assert refusal(ranks[2], Sharing("a", 1, 2)) == (
        f"{tmp_path}: rank 1 of this conversion is already writing into this folder")
    assert refusal(ranks[2], Sharing("b", 0, 2)).startswith(f"{tmp_path}: another aoa convert")
    assert refusal(ranks[2], Sharing("a", 2, 3)).startswith(f"{tmp_path}: another aoa convert")
    assert refusal(ranks[2]).startswith(f"{tmp_path}: another aoa convert")
    stage(ranks[1], "rank-1")
    ranks[1].mark_done()
    ranks[1].release()
    stage(ranks[0], "rank-0")
    ranks[0].wait_for_ranks(poll_seconds=0.01, timeout=1)
    ranks[0].publish(["rank-0", "rank-1"], [])
    ranks[0].release()
    assert sorted(os.listdir(tmp_path)) == ["rank-0", "rank-1"]


def test_a_rank_that_finished_leaves_its_files_for_rank_0(tmp_path: Path) -> None:
    """Ranks started one after another: the staged files survive in between, and only a
    rank of the same conversion keeps them."""
    early = folder(tmp_path)
    early.open(Sharing("a", 1, 2))
    stage(early, "rank-1")
    early.mark_done()
    early.release()
    assert sorted(os.listdir(tmp_path / STAGING_NAME)) == [
        ".aoa-done-rank-00001-of-00002", ".aoa-owner", "rank-1"]
    late = folder(tmp_path)
    late.open(Sharing("a", 0, 2))
    late.wait_for_ranks(poll_seconds=0.01, timeout=1)
    late.release()  # failed before publishing: rank 1's files stay for the next try
    assert (tmp_path / STAGING_NAME / "rank-1").exists()
    other = folder(tmp_path)
    other.open(Sharing("b", 0, 2))  # another conversion: they were stale
    assert not (tmp_path / STAGING_NAME / "rank-1").exists()
    other.release()
    assert os.listdir(tmp_path) == []


def test_waiting_for_a_rank_that_never_comes(tmp_path: Path) -> None:
    output = folder(tmp_path)
    output.open(Sharing("a", 0, 3))
    with pytest.raises(StorageError) as caught:
        output.wait_for_ranks(poll_seconds=0.01, timeout=0.05)
    assert caught.value.message == (f"{tmp_path}: ranks [1, 2] did not finish within 0 s; "
                                    "nothing is published")
    output.abort()
    assert os.listdir(tmp_path) == []


def test_a_failing_rank_removes_only_its_own_files(tmp_path: Path) -> None:
    ranks = [folder(tmp_path) for _ in range(2)]
    for rank, output in enumerate(ranks):
        output.open(Sharing("a", rank, 2))
        stage(output, f"rank-{rank}")
    ranks[1].mark_done()
    ranks[0].abort()
    assert sorted(os.listdir(tmp_path / STAGING_NAME)) == [
        ".aoa-done-rank-00001-of-00002", ".aoa-owner", "rank-1"]
    ranks[1].abort()  # the last one out: nothing of the conversion is left
    assert os.listdir(tmp_path) == []


def test_staging_left_by_a_killed_run_is_cleared(tmp_path: Path) -> None:
    (tmp_path / STAGING_NAME).mkdir()
    (tmp_path / STAGING_NAME / "model.safetensors").write_bytes(b"half")
    (tmp_path / LOCK_NAME).write_text('{"pid": 1}')
    output = folder(tmp_path)
    output.open()
    assert os.listdir(tmp_path / STAGING_NAME) == [".aoa-owner"]
    stage(output, "model.safetensors", b"whole")
    output.publish(["model.safetensors"], [])
    output.release()
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == b"whole"


def test_publishing_names_a_file_no_rank_staged(tmp_path: Path) -> None:
    output = folder(tmp_path)
    output.open(Sharing("a", 0, 2))
    stage(output, "rank-0")
    with pytest.raises(StorageError) as caught:
        output.publish(["rank-0", "rank-1"], ["index"])
    assert caught.value.message == (f"{tmp_path}: rank-1 is not among the staged files "
                                    "(1 more missing)")
    assert caught.value.hint == ("Every rank writes into the same folder: give them a shared "
                                 "file system.")
    output.abort()


def test_a_folder_holding_a_checkpoint_is_refused_before_anything(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert refusal(folder(tmp_path)) == (
        f"{tmp_path}: the output folder already holds a checkpoint (model.safetensors)")
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".aoa-owner"])
def test_staged_names_stay_inside(tmp_path: Path, name: str) -> None:
    output = folder(tmp_path)
    output.open()
    with pytest.raises(StorageError) as caught:
        output.stage(name)
    assert caught.value.message == f"{tmp_path}: '{name}' is not a file name for the output"
    output.release()


HOLD = """\
import sys, time
from aoa.storage.folder import OutputFolder
from aoa.storage.formats import checkpoint_patterns
output = OutputFolder(sys.argv[1], checkpoint_patterns())
output.open()
output.stage("model.safetensors").write_bytes(b"half")
print("locked", flush=True)
time.sleep(60)
"""


def test_a_killed_holder_frees_the_folder(tmp_path: Path) -> None:
    """The kernel drops the lock of a process that dies; the next run clears its staging."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        assert refusal(folder(tmp_path)).startswith(
            f"{tmp_path}: another aoa convert is writing into this folder (process "
            f"{holder.pid}, since ")
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10
    output = folder(tmp_path)
    while True:
        try:
            output.open()
            break
        except StorageError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert os.listdir(tmp_path / STAGING_NAME) == [".aoa-owner"]
    output.release()
    assert os.listdir(tmp_path) == []
