"""The in-place writer that safetensors files and DCP archives are written through: bytes land
where the views say, nothing is under the final name until commit, and every way out of a
``with`` block without a commit leaves nothing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from aoa.errors import StorageError
from aoa.storage.in_place import InPlaceWriter, partial_path


def test_views_land_at_their_offsets_and_commit_publishes(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    expected = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    with InPlaceWriter(path, len(expected)) as writer:
        writer.view(0, 4000)[:] = expected[:4000].tobytes()
        writer.view(4000)[:] = expected[4000:].tobytes()
        assert os.listdir(tmp_path) == [partial_path(path).name]
        assert writer.commit() == path
    assert os.listdir(tmp_path) == ["f.bin"]
    assert np.array_equal(np.fromfile(path, np.uint8), expected)


@pytest.mark.parametrize("offset, nbytes", [(-1, 2), (9, 2), (0, 11), (3, -1)])
def test_a_view_outside_the_file_is_refused(tmp_path: Path, offset: int, nbytes: int) -> None:
    with InPlaceWriter(tmp_path / "f.bin", 10) as writer, \
            pytest.raises(StorageError) as refused:
        writer.view(offset, nbytes)
    assert refused.value.message == (f"{tmp_path / 'f.bin'}: bytes [{offset}, "
                                     f"{offset + nbytes}) lie outside the file's 10")
    assert os.listdir(tmp_path) == []


def test_an_empty_file_commits(tmp_path: Path) -> None:
    with InPlaceWriter(tmp_path / "empty.bin", 0) as writer:
        assert len(writer.view()) == 0
        writer.commit()
    assert (tmp_path / "empty.bin").read_bytes() == b""


def test_a_view_after_finish_is_refused_and_stale_views_are_released(tmp_path: Path) -> None:
    with InPlaceWriter(tmp_path / "f.bin", 3) as writer:
        view = writer.view()
        view[:] = b"abc"
        writer.commit()
        with pytest.raises(ValueError):  # released: it cannot write into the finished file
            view[0] = 0
        with pytest.raises(StorageError, match="already finished"):
            writer.view(0, 1)
    assert (tmp_path / "f.bin").read_bytes() == b"abc"


def test_a_failure_after_commit_removes_the_published_file(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), InPlaceWriter(tmp_path / "f.bin", 3) as writer:
        writer.view()[:] = b"abc"
        writer.commit()
        raise RuntimeError("a later step failed")
    assert os.listdir(tmp_path) == []


def test_an_unwritable_folder_is_a_storage_error(tmp_path: Path) -> None:
    with pytest.raises(StorageError) as refused:
        InPlaceWriter(tmp_path / "missing" / "f.bin", 3)
    assert refused.value.message.startswith(f"{tmp_path / 'missing' / 'f.bin'}: cannot write:")
