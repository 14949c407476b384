"""Reading a conversion's source ranges into the page cache ahead of the fills."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import struct
import threading
import time
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors_files import save

import aoa.runtime.executor as executor_module
from aoa.jobs.convert import execute, prepare
from aoa.storage import open_source, read_ahead
from aoa.storage.read_ahead import MERGE_GAP, STREAMS, ReadAhead

MIB = 1 << 20
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached(path: Path, start: int, end: int) -> float:
    """The share of the pages of bytes [start, end) of ``path`` in the page cache
    (``mincore`` over a mapping of its own: the test's reference, not aoa's probe)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value)
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = ctypes.create_string_buffer(pages)
            assert _libc.mincore(address, size, vector) == 0
            first, last = start // mmap.PAGESIZE, -(-end // mmap.PAGESIZE)
            return sum(byte & 1 for byte in vector.raw[first:last]) / (last - first)
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)


def cold_file(path: Path, nbytes: int) -> Path:
    """A file of random bytes out of the page cache; skips where it cannot be dropped (a
    file system in memory)."""
    path.write_bytes(np.random.default_rng(0).integers(0, 256, nbytes, np.uint8).tobytes())
    with open(path, "rb") as file:
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if cached(path, 0, nbytes) > 0.01:
        pytest.skip(f"{path.parent}: its pages cannot be dropped from the page cache")
    return path


def wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def as_runs(files, starts, ends):
    """The reference for `_merged`: one range after another, a new run wherever the file
    changes, the range starts before the last one did, or past the last end by more than
    `MERGE_GAP`."""
    runs: list[list[int]] = []
    of: list[int] = []
    for file, start, end in zip(files, starts, ends):
        last = runs[-1] if runs else None
        if (last is None or file != last[0] or start < last[3]
                or start - last[4] > MERGE_GAP):
            runs.append([file, start, end, start, end])  # file, start, end, last start, end
        else:
            last[2] = max(last[2], end)
            last[3], last[4] = start, end
        of.append(len(runs) - 1)
    return [tuple(run[:3]) for run in runs], of


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 8 * MIB),
                          st.integers(0, 2 * MIB)), max_size=40))
def test_ranges_are_merged_into_runs_as_a_plain_walk_merges_them(ranges) -> None:
    files = np.array([f for f, _, _ in ranges], np.int64)
    starts = np.array([s for _, s, _ in ranges], np.int64)
    ends = starts + np.array([n for _, _, n in ranges], np.int64)
    if not ranges:
        return
    run_files, run_starts, run_ends, run_of = read_ahead._merged(files, starts, ends)
    runs, of = as_runs(files.tolist(), starts.tolist(), ends.tolist())
    assert list(zip(run_files.tolist(), run_starts.tolist(), run_ends.tolist())) == runs
    assert run_of.tolist() == of


def test_ranges_of_a_cold_file_are_read_into_the_page_cache(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "source", 48 * MIB)
    ahead = ReadAhead([path])
    try:
        marks = ahead.expect(np.array([0, 0]), np.array([2 * MIB, 9 * MIB]),
                             np.array([3 * MIB, 2 * MIB]))
        assert marks.tolist() == [3 * MIB, 5 * MIB]
        ahead.reached(int(marks[-1]))
        assert wait_until(lambda: cached(path, 2 * MIB, 5 * MIB) == 1
                          and cached(path, 9 * MIB, 11 * MIB) == 1)
    finally:
        ahead.close()
    assert cached(path, 40 * MIB, 48 * MIB) == 0  # far from both: never asked for


def test_reading_runs_no_further_than_its_window_past_the_fills(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "source", 64 * MIB)
    ahead = ReadAhead([path], window=0)
    try:
        marks = ahead.expect(np.array([0, 0]), np.array([0, 40 * MIB]),
                             np.array([MIB, MIB]))
        assert wait_until(lambda: cached(path, 0, MIB) == 1)
        time.sleep(0.3)
        assert cached(path, 40 * MIB, 41 * MIB) == 0  # past the window: not yet
        ahead.reached(int(marks[0]))  # the fills are at the end of the first range
        assert wait_until(lambda: cached(path, 40 * MIB, 41 * MIB) == 1)
    finally:
        ahead.close()


def test_a_file_in_the_page_cache_is_not_read_again(tmp_path: Path) -> None:
    path = tmp_path / "source"
    path.write_bytes(bytes(4 * MIB))
    path.read_bytes()
    ahead = ReadAhead([path])
    assert not ahead.wanted
    marks = ahead.expect(np.array([0]), np.array([0]), np.array([4 * MIB]))
    assert marks.tolist() == [0]  # nothing queued: the fills read it from memory
    assert ahead._threads == []  # and no thread started
    ahead.close()


def test_a_file_that_cannot_be_read_ahead_is_left_to_the_fills(tmp_path: Path) -> None:
    path = cold_file(tmp_path / "source", 4 * MIB)
    gone = cold_file(tmp_path / "gone", MIB)
    ahead = ReadAhead([path, gone])
    assert ahead.wanted
    gone.unlink()
    try:
        ahead.expect(np.array([1, 0]), np.array([0, 0]), np.array([MIB, MIB]))
        ahead.reached(2 * MIB)
        assert wait_until(lambda: cached(path, 0, MIB) == 1)  # the next file's: read still
        assert wait_until(lambda: not ahead._cold[1])  # the gone one's: no more
        marks = ahead.expect(np.array([1]), np.array([0]), np.array([MIB]))
        assert marks.tolist() == [2 * MIB]  # not queued: its mark is the one before it
    finally:
        ahead.close()
    assert not any(thread.is_alive() for thread in ahead._threads)


class Descriptors:
    """`os` for `aoa.storage.read_ahead`, counting the files it holds open at once (not
    ``/dev/null``) and the chunks it reads (file descriptor's path, offset, bytes)."""

    def __init__(self) -> None:
        self.open_now = 0
        self.most = 0
        self.paths: dict[int, str] = {}
        self.sent: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(os, name)

    def open(self, path, flags):
        fd = os.open(path, flags)
        if str(path) != os.devnull:
            with self._lock:
                self.paths[fd] = str(path)
                self.open_now += 1
                self.most = max(self.most, self.open_now)
        return fd

    def close(self, fd: int) -> None:
        with self._lock:
            if self.paths.pop(fd, None) is not None:
                self.open_now -= 1
        os.close(fd)

    def sendfile(self, out: int, fd: int, offset: int, count: int) -> int:
        with self._lock:
            self.sent.append((self.paths[fd], offset, count))
        return os.sendfile(out, fd, offset, count)


def test_each_byte_asked_for_is_read_once_in_chunks_holding_a_file_open_per_stream(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [cold_file(tmp_path / f"source-{n}", 4 * MIB) for n in range(3 * STREAMS)]
    monkeypatch.setattr(read_ahead, "CHUNK_BYTES", MIB // 2)
    shim = Descriptors()
    monkeypatch.setattr(read_ahead, "os", shim)
    ahead = ReadAhead(paths)
    try:
        files = np.repeat(np.arange(len(paths)), 2)
        offsets = np.tile([0, 3 * MIB], len(paths))  # two runs a file (further than MERGE_GAP)
        nbytes = np.tile([MIB + 5, 4096], len(paths))
        marks = ahead.expect(files, offsets, nbytes)
        ahead.reached(int(marks[-1]))
        assert wait_until(lambda: len(shim.sent) == 4 * len(paths))
    finally:
        ahead.close()
    assert shim.open_now == 0  # every file closed again
    assert 1 <= shim.most <= STREAMS  # a stream holds the file of its last chunk only
    read = sorted(shim.sent)
    wanted = sorted([(str(path), 0, MIB // 2) for path in paths]
                    + [(str(path), MIB // 2, MIB // 2) for path in paths]
                    + [(str(path), MIB, 5) for path in paths]
                    + [(str(path), 3 * MIB, 4096) for path in paths])
    assert read == wanted


def test_several_chunks_are_read_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """`STREAMS` reads wait on the device at once (what makes a cold source come in at the
    device's speed): each read here waits until another is under way too."""
    path = cold_file(tmp_path / "source", 8 * MIB)
    monkeypatch.setattr(read_ahead, "CHUNK_BYTES", MIB)
    together = threading.Barrier(2, timeout=10)
    shim = Descriptors()

    def sendfile(out: int, fd: int, offset: int, count: int) -> int:
        together.wait()  # breaks (and the stream stops) unless a second read comes
        return Descriptors.sendfile(shim, out, fd, offset, count)

    shim.sendfile = sendfile  # type: ignore[method-assign]
    monkeypatch.setattr(read_ahead, "os", shim)
    ahead = ReadAhead([path])
    try:
        marks = ahead.expect(np.array([0]), np.array([0]), np.array([8 * MIB]))
        ahead.reached(int(marks[-1]))
        assert wait_until(lambda: len(shim.sent) == 8)  # (each recorded once under way)
    finally:
        ahead.close()
    assert sorted(offset for _, offset, _ in shim.sent) == [n * MIB for n in range(8)]


class Recording:
    """Stands for `ReadAhead` in the executor: the ranges expected, in order, each one's
    mark, and the last mark reached."""

    instances: ClassVar[list[Recording]] = []

    wanted = True

    def __init__(self, paths) -> None:
        self.paths = list(paths)
        self.expected: list[tuple[int, int, int]] = []
        self.marks: dict[tuple[int, int], int] = {}
        self.at = 0
        self.closed = False
        Recording.instances.append(self)

    def expect(self, files, offsets, nbytes):
        rows = list(zip(files.tolist(), offsets.tolist(), nbytes.tolist()))
        total = sum(n for _, _, n in self.expected)
        marks = []
        for file, offset, count in rows:
            total += count
            self.marks[(file, offset)] = total
            marks.append(total)
        self.expected += rows
        return np.array(marks, np.int64)

    def reached(self, mark: int) -> None:
        self.at = max(self.at, mark)  # (a later file's shards may read nothing new)

    def close(self) -> None:
        self.closed = True


def header_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's (offset, bytes) in a safetensors file, from its JSON header."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    return {name: (8 + length + entry["data_offsets"][0],
                   entry["data_offsets"][1] - entry["data_offsets"][0])
            for name, entry in header.items() if name != "__metadata__"}


def test_a_conversion_asks_for_each_source_range_once_before_the_fill_that_reads_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    arrays = {f"a.{layer}.{name}": rng.standard_normal((64, 32), dtype=np.float32)
              for layer in range(6) for name in ("gate", "up")}
    source = tmp_path / "src"
    source.mkdir()
    save(source / "model.safetensors", arrays)
    mapping = ("a.$LAYER_ID.gate^T, a.$LAYER_ID.up^T -> b.$LAYER_ID.up_gate, fused_ffn\n")
    from aoa.mesh_layout import read_mesh_layout

    (tmp_path / "tp2.toml").write_text('[mesh]\ntp = 2\n\n[[rule]]\nmatch = "b.*.up_gate"\n'
                                       'tp = 1\n')
    layout = read_mesh_layout(tmp_path / "tp2.toml")
    monkeypatch.setattr(executor_module, "ReadAhead", Recording)
    monkeypatch.setattr("aoa.storage.writer.BUFFER_BYTES", 16384)  # many fills a file
    Recording.instances = []
    late: list[tuple[int, int]] = []
    run = executor_module._run

    def checked(backend, table, sources, destinations, windows, threads, source_windows):
        ahead = Recording.instances[-1]
        for _, offset, _ in source_windows.tolist():
            if ahead.marks[(0, offset)] > ahead.at:
                late.append((offset, ahead.at))
        run(backend, table, sources, destinations, windows, threads, source_windows)

    monkeypatch.setattr(executor_module, "_run", checked)
    with open_source(source) as checkpoint:
        conversion = prepare(mapping, checkpoint, layout=layout)
        execute(conversion, tmp_path / "out")
    (ahead,) = Recording.instances
    assert ahead.paths == [source / "model.safetensors"]
    assert ahead.closed
    ranges = header_ranges(source / "model.safetensors")
    assert sorted(ahead.expected) == sorted((0, *where) for where in ranges.values())
    assert late == []  # every fill's sources were asked for before it ran
    first_rank = header_ranges(tmp_path / "out" / "rank-00000-of-00002.safetensors")
    order = sorted(first_rank, key=lambda name: first_rank[name][0])  # as rank 0 is filled
    asked = [(0, *ranges[f"a.{name.split('.')[1]}.{part}"]) for name in order
             for part in ("gate", "up")]
    assert ahead.expected == list(dict.fromkeys(asked))


FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.mark.parametrize("fixture", ["paddle/single", "paddle/tp2", "dcp/tp2", "dcp/fsdp4",
                                     "torch_dist/tp2"])
def test_a_mapped_source_says_where_each_shard_lies(fixture: str) -> None:
    """The ranges a read-ahead is given hold the very bytes the framework saved for each
    shard (its part of the tensor in ``expected.npz``)."""
    with np.load(FIXTURES / fixture / "expected.npz") as saved:
        arrays = {key: saved[key] for key in saved.files if "@" not in key}
    with open_source(FIXTURES / fixture) as source:
        shards = [shard for found in source.shards.values() for shard in found]
        extents = source.plan_extents(shards)
        assert extents is not None
        paths, where = extents
        rows = where(np.arange(len(shards), dtype=np.int64)).tolist()
    assert len(rows) == len(shards)
    for shard, (number, offset, nbytes) in zip(shards, rows):
        box = tuple(slice(o, o + n) for o, n in zip(shard.global_offset, shard.local_shape))
        with open(paths[number], "rb") as file:
            file.seek(offset)
            assert file.read(nbytes) == np.ascontiguousarray(arrays[shard.key][box]).tobytes()


def test_a_torch_save_file_says_where_each_tensor_lies(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    arrays = {"w": rng.standard_normal((16, 8), dtype=np.float32),
              "b": rng.standard_normal(8).astype(np.float16)}
    torch.save({key: torch.from_numpy(array) for key, array in arrays.items()},
               tmp_path / "pytorch_model.bin")
    with open_source(tmp_path) as source:
        shards = [found[0] for found in source.shards.values()]
        extents = source.plan_extents(shards)
        assert extents is not None
        paths, where = extents
        rows = where(np.arange(len(shards), dtype=np.int64)).tolist()
    for shard, (number, offset, nbytes) in zip(shards, rows):
        with open(paths[number], "rb") as file:
            file.seek(offset)
            assert file.read(nbytes) == arrays[shard.key].tobytes()


def test_a_load_asks_for_its_sources_ahead_too(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import aoa

    rng = np.random.default_rng(3)
    arrays = {f"a.{n}": rng.standard_normal((32, 16), dtype=np.float32) for n in range(4)}
    save(tmp_path / "model.safetensors", arrays)
    monkeypatch.setattr(executor_module, "ReadAhead", Recording)
    Recording.instances = []
    into = {f"b.{n}": np.zeros((16, 32), np.float32) for n in range(4)}
    aoa.load("a.$LAYER_ID^T -> b.$LAYER_ID", source=tmp_path, into=into, progress=False)
    (ahead,) = Recording.instances
    assert ahead.closed
    ranges = header_ranges(tmp_path / "model.safetensors")
    assert sorted(ahead.expected) == sorted((0, *where) for where in ranges.values())
    for n in range(4):
        assert into[f"b.{n}"].tobytes() == arrays[f"a.{n}"].T.tobytes()
