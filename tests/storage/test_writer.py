"""Writing a file through staging buffers (`aoa.storage.writer`): every byte where the layout
says, whatever the buffers' size, with direct I/O or without, and errors that say so."""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aoa.errors import StorageError
from aoa.storage import writer
from aoa.storage.formats import FileLayout, Piece, ShardSpan, ShardSpans
from aoa.storage.writer import ALIGNMENT, StagingBuffers, start_file, write_file


def pattern(shard: int, itemsize: int, start: int, stop: int) -> bytes:
    """Elements [start, stop) of shard ``shard``: each item its element number and shard,
    so that a piece in the wrong place shows."""
    numbers = np.arange(start, stop, dtype=np.uint64) * 131 + shard * 7
    items = numbers.astype(np.uint64).view(np.uint8).reshape(-1, 8)[:, :itemsize]
    return items.tobytes()


class Recorder:
    """A Fill writing `pattern` into each piece, recording what it was handed."""

    def __init__(self, layout: FileLayout) -> None:
        self.spans = {span.shard: span for span in layout.shards}
        self.calls: list[list[tuple[int, tuple[int, int]]]] = []

    def __call__(self, pieces: Sequence[Piece]) -> None:
        call = []
        for piece in pieces:
            span = self.spans[piece.shard]
            start, stop = piece.elements or (0, span.nbytes // span.itemsize)
            view = memoryview(piece.buffer)  # type: ignore[arg-type]
            assert view.nbytes == (stop - start) * span.itemsize
            view[:] = pattern(piece.shard, span.itemsize, start, stop)
            call.append((piece.shard, (start, stop)))
        self.calls.append(call)


def expected(layout: FileLayout) -> bytes:
    data = bytearray(layout.size)
    for offset, fixed in layout.fixed:
        data[offset:offset + len(fixed)] = fixed
    for span in layout.shards:
        data[span.offset:span.offset + span.nbytes] = pattern(
            span.shard, span.itemsize, 0, span.nbytes // span.itemsize)
    return bytes(data)


@st.composite
def layouts(draw) -> FileLayout:
    """Headers, padding and shards of items of 1, 2, 4 or 8 bytes, back to back or apart,
    starting anywhere (a float32 after an odd bfloat16 is not 4-aligned in safetensors)."""
    fixed, shards, offset = [], [], 0
    for index in range(draw(st.integers(0, 8))):
        offset += draw(st.sampled_from([0, 0, 1, 3, 4096]))
        if draw(st.booleans()):
            data = draw(st.binary(min_size=1, max_size=300))
            fixed.append((offset, data))
            offset += len(data)
        else:
            itemsize = draw(st.sampled_from([1, 2, 4, 8]))
            count = draw(st.sampled_from([1, 3, 1000, 4099, 9000]))
            shards.append(ShardSpan(index, offset, count * itemsize, itemsize))
            offset += count * itemsize
    return FileLayout(offset + draw(st.sampled_from([0, 5])), fixed, shards)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), buffer_bytes=st.sampled_from([2 * ALIGNMENT, 3 * ALIGNMENT,
                                                        16 * ALIGNMENT]),
       as_columns=st.booleans())
def test_every_byte_lands_where_the_layout_says(tmp_path_factory, layout: FileLayout,
                                                 buffer_bytes: int, as_columns: bool) -> None:
    """Whether the layout lists its spans or gives them as `ShardSpans` columns."""
    if as_columns:
        columns = [[span[field] for span in layout.shards] for field in range(4)]
        layout = FileLayout(layout.size, layout.fixed, ShardSpans(*columns))
    path = tmp_path_factory.mktemp("writer") / "file"
    fill = Recorder(layout)
    with StagingBuffers(2, buffer_bytes) as buffers:
        write_file(path, layout, fill, buffers)
    assert path.read_bytes() == expected(layout)
    # each shard handed over once, in order, in pieces that fit one buffer each
    handed: dict[int, list[tuple[int, int]]] = {}
    for call in fill.calls:
        for shard, elements in call:
            handed.setdefault(shard, []).append(elements)
            assert (elements[1] - elements[0]) * fill.spans[shard].itemsize <= buffer_bytes
    for span in layout.shards:
        ranges = handed[span.shard]
        assert ranges[0][0] == 0 and ranges[-1][1] == span.nbytes // span.itemsize
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@settings(max_examples=30, deadline=None)
@given(files=st.lists(layouts(), min_size=1, max_size=4),
       buffer_bytes=st.sampled_from([2 * ALIGNMENT, 3 * ALIGNMENT]))
def test_files_started_one_after_another_share_the_buffers(tmp_path_factory, files,
                                                           buffer_bytes: int) -> None:
    """Each file finishes (last writes, fsync) while the next is filled, through the same
    buffers: every file's bytes as its layout says once the buffers have finished them."""
    folder = tmp_path_factory.mktemp("files")
    with StagingBuffers(2, buffer_bytes) as buffers:
        for number, layout in enumerate(files):
            start_file(folder / str(number), layout, Recorder(layout), buffers)
        assert buffers.finish() == [True] * len(files)
    for number, layout in enumerate(files):
        assert (folder / str(number)).read_bytes() == expected(layout)


def test_a_failed_fsync_is_raised_once_every_file_is_finished(tmp_path: Path,
                                                              monkeypatch) -> None:
    """"a" fails its fsync only once "b" has been started (each file finishes on a thread
    of its own, so without the wait either could fsync first, or "a" fail before "b"
    starts): "b" is finished all the same, and the failure names "a"."""
    real_fsync = os.fsync
    synced: list[str] = []
    both_started = threading.Event()

    def fsync(fd: int) -> None:
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        synced.append(name)
        if name == "a":
            assert both_started.wait(10)
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    layout = small_layout()
    with pytest.raises(StorageError) as caught, StagingBuffers(2, 2 * ALIGNMENT) as buffers:
        for name in ("a", "b"):
            start_file(tmp_path / name, layout, Recorder(layout), buffers)
        both_started.set()
        buffers.finish()
    assert caught.value.message == f"{tmp_path / 'a'}: cannot write: Input/output error"
    assert sorted(synced) == ["a", "b"]  # the second file was finished all the same
    assert (tmp_path / "b").read_bytes() == expected(layout)


def test_a_file_that_failed_to_finish_stops_the_next_one(tmp_path: Path, monkeypatch) -> None:
    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    layout = small_layout()
    second = Recorder(layout)
    with pytest.raises(StorageError) as caught, StagingBuffers(2, 2 * ALIGNMENT) as buffers:
        start_file(tmp_path / "a", layout, Recorder(layout), buffers).wait()
        start_file(tmp_path / "b", layout, second, buffers)
    assert caught.value.message == f"{tmp_path / 'a'}: cannot write: Input/output error"
    assert second.calls == []  # "b" was not filled, nor made
    assert not (tmp_path / "b").exists()


def test_one_fill_per_buffer(tmp_path: Path) -> None:
    """Many small shards in one buffer are one kernel call, not one each."""
    shards = [ShardSpan(i, 8 * i, 8, 4) for i in range(1000)]
    layout = FileLayout(8000, [], shards)
    fill = Recorder(layout)
    with StagingBuffers() as buffers:
        assert write_file(tmp_path / "f", layout, fill, buffers) is True
    assert [len(call) for call in fill.calls] == [1000]
    assert (tmp_path / "f").read_bytes() == expected(layout)


def small_layout() -> FileLayout:
    return FileLayout(3 * ALIGNMENT + 10, [(0, b"header")],
                      [ShardSpan(0, 16, 3 * ALIGNMENT - 8, 4)])


def test_a_file_system_refusing_direct_io_at_open(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    layout = small_layout()
    with StagingBuffers(2, 2 * ALIGNMENT) as buffers:
        assert write_file(tmp_path / "f", layout, Recorder(layout), buffers) is False
    assert (tmp_path / "f").read_bytes() == expected(layout)


def test_a_file_system_refusing_direct_writes(tmp_path: Path, monkeypatch) -> None:
    """Some file systems open with O_DIRECT and refuse the write: the writer carries on
    through the page cache."""
    import fcntl

    real_pwrite = os.pwrite
    refused = []

    def refuse_direct(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_direct)
    layout = small_layout()
    with StagingBuffers(2, 2 * ALIGNMENT) as buffers:
        assert write_file(tmp_path / "f", layout, Recorder(layout), buffers) is False
    assert refused
    assert (tmp_path / "f").read_bytes() == expected(layout)


def test_both_writers_refused_direct_writes_at_once(tmp_path: Path, monkeypatch) -> None:
    """Both writer threads are refused before either has left direct I/O: the one that
    finds it done already carries on through the page cache too."""
    import fcntl
    import threading

    real_pwrite = os.pwrite
    together = threading.Barrier(2, timeout=10)

    def refuse_direct(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            together.wait()  # both writes are in flight, refused at once
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_direct)
    layout = small_layout()
    with StagingBuffers(2, 2 * ALIGNMENT) as buffers:
        assert write_file(tmp_path / "f", layout, Recorder(layout), buffers) is False
    assert (tmp_path / "f").read_bytes() == expected(layout)


def test_a_full_disk_during_the_writes(tmp_path: Path, monkeypatch) -> None:
    real_pwrite = os.pwrite

    def full(fd, data, offset):
        if offset >= ALIGNMENT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full)
    layout = small_layout()
    with pytest.raises(StorageError) as caught, StagingBuffers(2, 2 * ALIGNMENT) as buffers:
        write_file(tmp_path / "f", layout, Recorder(layout), buffers)
    assert caught.value.message == f"{tmp_path / 'f'}: cannot write: No space left on device"


def test_a_full_disk_before_the_writes(tmp_path: Path, monkeypatch) -> None:
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    layout = small_layout()
    fill = Recorder(layout)
    with pytest.raises(StorageError) as caught, StagingBuffers(2, 2 * ALIGNMENT) as buffers:
        write_file(tmp_path / "f", layout, fill, buffers)
    assert caught.value.message == (f"{tmp_path / 'f'}: cannot reserve {layout.size} bytes: "
                                    "No space left on device")
    assert fill.calls == []  # nothing was copied


def test_a_failing_fill_stops_the_writers(tmp_path: Path) -> None:
    layout = FileLayout(40 * ALIGNMENT, [], [ShardSpan(0, 0, 40 * ALIGNMENT, 8)])
    calls = []

    def fill(pieces: Sequence[Piece]) -> None:
        calls.append(len(pieces))
        if len(calls) == 3:
            raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"), \
            StagingBuffers(2, 2 * ALIGNMENT) as buffers:
        write_file(tmp_path / "f", layout, fill, buffers)
    assert len(calls) == 3


def test_overlapping_layouts_are_refused(tmp_path: Path) -> None:
    layout = FileLayout(100, [(0, b"x" * 10)], [ShardSpan(0, 8, 8, 4)])
    with pytest.raises(StorageError) as caught, StagingBuffers() as buffers:
        write_file(tmp_path / "f", layout, Recorder(layout), buffers)
    assert caught.value.message == (f"{tmp_path / 'f'}: the format laid out overlapping bytes "
                                    "at offset 8 (of 100)")


def test_an_empty_file(tmp_path: Path) -> None:
    with StagingBuffers() as buffers:
        write_file(tmp_path / "f", FileLayout(0, [], []), Recorder(FileLayout(0, [], [])),
                   buffers)
    assert (tmp_path / "f").read_bytes() == b""


def test_buffers_of_whole_blocks() -> None:
    with pytest.raises(ValueError, match="two or more buffers of whole 4 KiB blocks"):
        StagingBuffers(2, ALIGNMENT + 1)
    assert writer.BUFFER_BYTES % ALIGNMENT == 0



@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux's /proc only")
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs /proc/self/smaps")
def test_staging_buffers_are_private_memory_asking_for_huge_pages():
    """Direct writes from 2 MiB pages reach the device as its largest requests
    (bench/README.md: staging buffers in huge pages). A kernel built without transparent
    huge pages refuses the advice, and the buffers stay in 4 KiB pages."""
    with StagingBuffers(2, 4 << 20) as buffers:
        buffer = buffers.take()
        address = np.frombuffer(buffer, np.uint8).ctypes.data
        flags = mapping_flags(address)
        buffers.free.put(buffer)
    assert "sh" not in flags  # private, not shared
    if hasattr(mmap, "MADV_HUGEPAGE") and Path(_THP).exists():
        assert "hg" in flags  # MADV_HUGEPAGE


#: Present where the kernel has transparent huge pages (whatever their setting).
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def mapping_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")
