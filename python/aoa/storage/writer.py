"""Writing one destination file at disk speed, in memory that does not grow with the file.

A format says what a file holds as a `FileLayout`: its size, the bytes the format writes
itself (headers, pickles) and where each destination shard's bytes go. `write_file` walks
the file front to back through a few aligned staging buffers: the kernel fills one (one
`Fill` call for every shard, or element range of a shard, that falls in it) while writer
threads write the others with ``O_DIRECT``. Filling and writing overlap, the page cache is
never filled (so fsync has nothing left to write back), and memory stays at the buffers
whatever the size of the file.

Direct I/O wants offsets, lengths and memory aligned to the device's blocks: the buffers
are page-aligned anonymous memory, in huge pages where the system gives them (`_buffer`:
the device then gets requests of its largest size); each is written up to the last 4 KiB
boundary it reaches, and the bytes past it (less than 4 KiB) open the next buffer; the last
one is padded, and the file cut to its size. Where the file system refuses ``O_DIRECT`` (at open
or at the first write), the same buffers go through the page cache instead, and the file
is fsynced; `write_file` says which way it wrote.

The file's blocks are reserved before a byte is written, so a full disk is an error before
anything is copied rather than halfway through.

Files of one write go one after the other through the same buffers (`start_file`): once a
file's last buffer is handed to the writers, its last writes, its truncation and its fsync
finish in the background while the next file is laid out and filled, so the disk does not
wait for the filling, nor the filling for the disk, at each file's end.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import mmap
import os
import queue
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, overload

import numpy as np

from aoa.errors import StorageError
from aoa.storage.formats import Expect, FileLayout, Fill, Piece, ShardSpans
from aoa.storage.in_place import allocate

#: Offsets, lengths and buffer addresses of direct writes are multiples of this.
ALIGNMENT = 4096
#: Bytes per staging buffer, and how many there are: one being filled while the others are
#: written. Measured on the 1.55 GB benchmark (bench/convert.py): see bench/README.md.
BUFFER_BYTES = 32 << 20
BUFFERS = 4
#: Threads writing buffers at once (direct writes at a queue depth above one).
WRITERS = 2

_O_DIRECT = getattr(os, "O_DIRECT", 0)


class StagingBuffers:
    """The aligned buffers of a write, shared by its files one after the other (allocated
    on first use), and the files still finishing in the background (`start_file`): leaving
    the ``with`` block waits for them."""

    def __init__(self, count: int | None = None, nbytes: int | None = None) -> None:
        count = BUFFERS if count is None else count
        nbytes = BUFFER_BYTES if nbytes is None else nbytes
        if nbytes % ALIGNMENT or nbytes < 2 * ALIGNMENT or count < 2:
            raise ValueError("staging needs two or more buffers of whole 4 KiB blocks")
        self.count = count
        self.nbytes = nbytes
        self._buffers: list[mmap.mmap] = []
        #: the buffers no write holds, whichever file they last held; the one handed back
        #: last is taken first, so that where the writes keep up with the filling only two
        #: buffers are ever touched (a fresh buffer's first touch costs a page fault and a
        #: zeroed page per 4 KiB: 128 MiB of them took 70 ms, a third of the kernel's work
        #: on 194 MB of small tensors)
        self.free: queue.LifoQueue[mmap.mmap] = queue.LifoQueue()
        #: the files started and not yet waited for (`start_file`)
        self.finishing: list[FileWrite] = []

    def take(self) -> mmap.mmap:
        """A free buffer: waits for a write to hand one back."""
        if not self._buffers:
            self._buffers = [_buffer(self.nbytes) for _ in range(self.count)]
            for buffer in self._buffers:
                self.free.put(buffer)
        return self.free.get()

    def finish(self) -> list[bool]:
        """Wait for every file still finishing; whether each went around the page cache, in
        the order they were started. Raises the first failure (after waiting for all)."""
        for file in self.finishing:  # all of them, before any failure is raised
            file.wait()
        finishing, self.finishing = self.finishing, []
        return [file.result() for file in finishing]

    def check(self) -> None:
        """Raise the failure of a file that finished with one, before another is started."""
        for file in self.finishing:
            if file.failed:
                self.finish()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.finish()
        for buffer in self._buffers:
            with contextlib.suppress(BufferError):
                buffer.close()
        self._buffers = []
        self.free = queue.LifoQueue()

    def __enter__(self) -> StagingBuffers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _buffer(nbytes: int) -> mmap.mmap:
    """Private anonymous memory for a staging buffer, asked to be backed by huge pages
    (``MADV_HUGEPAGE``; where transparent huge pages are off, 4 KiB ones as before). A
    direct write from memory in 4 KiB pages reaches the device as requests of scattered
    pages, about 1 MiB each here (254 segments); from 2 MiB pages, as requests of
    ``max_sectors_kb`` (4 MiB): 1.55 GB written in 2.07 s instead of 3.53 s, dd 4.06 s
    (bench/direct_writes.py, medians of six)."""
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous: no file
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


def write_file(path: Path, layout: FileLayout, fill: Fill, buffers: StagingBuffers, *,
               direct: bool = True) -> bool:
    """Write ``path`` as ``layout`` says, the shards' bytes from ``fill``, and fsync it.
    Returns whether it went around the page cache (direct I/O). A failure raises; the
    caller removes the file."""
    return start_file(path, layout, fill, buffers, direct=direct).result()


class FileWrite:
    """A file whose bytes are all with the writers: its last writes, truncation and fsync
    run on a thread of their own. `result` waits and says whether the file went around the
    page cache; a failure raises there."""

    def __init__(self, path: Path, fd: int, size: int, writes: _Writes) -> None:
        self.path = path
        self._fd = fd
        self._size = size
        self._writes = writes
        self._direct = writes.direct
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._finish, name="aoa-finish", daemon=True)
        self._thread.start()

    @property
    def direct(self) -> bool:
        """Whether the file goes around the page cache, as far as is known yet."""
        return self._writes.direct

    @property
    def failed(self) -> bool:
        """Whether the file has finished, and failed."""
        return not self._thread.is_alive() and self._error is not None

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> bool:
        self.wait()
        if self._error is not None:
            raise self._error
        return self._direct

    def _finish(self) -> None:
        try:
            try:
                self._writes.finish()
                self._direct = self._writes.direct
                os.ftruncate(self._fd, self._size)  # the last block's padding
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
        except OSError as error:
            self._error = StorageError(f"{self.path}: cannot write: {error.strerror}")
            self._error.__cause__ = error
        except BaseException as error:  # said by `result`
            self._error = error


def start_file(path: Path, layout: FileLayout, fill: Fill, buffers: StagingBuffers, *,
               direct: bool = True, expect: Expect | None = None) -> FileWrite:
    """Lay ``path`` out in staging buffers as ``layout`` says, the shards' bytes from
    ``fill``, and hand them all to the writers; the file then finishes (last writes, fsync)
    in the background while the caller goes on to the next file: `FileWrite.result`, or
    ``buffers.finish()`` for every file started, waits for it. A failure before the hand-over
    raises here, having waited for the file's writes in flight; the caller removes the file.
    A file started before that failed to finish is raised here, before this one starts.
    ``expect``, if given, is told the file's shards in the order they will be filled."""
    buffers.check()
    fixed, spans = _items(path, layout)
    if expect is not None:
        expect(spans.shards)
    fd, direct = _open(path, direct)
    try:
        _reserve(fd, path, layout.size)
        writes = _Writes(fd, path, direct, buffers)
    except BaseException:
        os.close(fd)
        raise
    stream: _Stream | None = None
    try:
        stream = _Stream(writes, fill)
        done = 0
        for offset, data in fixed:
            before = int(np.searchsorted(spans.offsets, offset))
            stream.shards(spans.part(done, before))
            done = before
            stream.zeros(offset - stream.position)
            stream.put(data)
        stream.shards(spans.part(done, len(spans.offsets)))
        stream.zeros(layout.size - stream.position)
        stream.flush(last=True)
    except BaseException:
        if stream is not None:
            stream.abandon()
        writes.stop()  # a failure or an interrupt: wait for the writes in flight
        os.close(fd)
        raise
    started = FileWrite(path, fd, layout.size, writes)
    buffers.finishing.append(started)
    return started


class _Spans(NamedTuple):
    """Shard spans as arrays, in file order."""

    shards: np.ndarray
    offsets: np.ndarray
    nbytes: np.ndarray
    itemsizes: np.ndarray

    def part(self, start: int, stop: int) -> _Spans:
        return _Spans(*(column[start:stop] for column in self))


def _items(path: Path, layout: FileLayout) -> tuple[list[tuple[int, bytes]], _Spans]:
    """Fixed bytes and shards in file order, checked to lie apart inside the file."""
    fixed = sorted(((offset, data) for offset, data in layout.fixed if data),
                   key=lambda item: item[0])
    if isinstance(layout.shards, ShardSpans):
        table = np.array(layout.shards.columns, np.int64).reshape(4, -1).T
    else:
        table = np.fromiter(itertools.chain.from_iterable(layout.shards), np.int64,
                            count=4 * len(layout.shards)).reshape(-1, 4)
    table = table[table[:, 2] > 0]
    table = table[np.argsort(table[:, 1], kind="stable")]
    spans = _Spans(*(np.ascontiguousarray(column) for column in table.T))
    starts = np.concatenate([np.array([o for o, _ in fixed], np.int64), spans.offsets])
    ends = starts + np.concatenate([np.array([len(d) for _, d in fixed], np.int64),
                                    spans.nbytes])
    order = np.argsort(starts, kind="stable")  # fixed bytes before a shard at their offset
    starts, ends = starts[order], ends[order]
    bad = ends > layout.size
    bad[1:] |= starts[1:] < ends[:-1]
    if bad.any():
        offset = int(starts[np.argmax(bad)])
        raise StorageError(f"{path}: the format laid out overlapping bytes at offset "
                           f"{offset} (of {layout.size})")
    return fixed, spans


class StagedPieces(Sequence[Piece]):
    """The pieces of one staging buffer, as arrays: destination shard ``shards[i]`` lies at
    byte ``offsets[i]`` of ``buffer``, ``nbytes[i]`` long, and holds its elements
    [firsts[i], lasts[i]) (the whole shard where ``firsts[i]`` is -1).

    It reads as a sequence of `Piece` for any `Fill` (each one made when read); the executor
    takes the arrays as they are, with no Python work per piece."""

    __slots__ = ("buffer", "firsts", "lasts", "nbytes", "offsets", "shards")

    def __init__(self, buffer: mmap.mmap, shards: np.ndarray, offsets: np.ndarray,
                 nbytes: np.ndarray, firsts: np.ndarray, lasts: np.ndarray) -> None:
        self.buffer = buffer
        self.shards = shards
        self.offsets = offsets
        self.nbytes = nbytes
        self.firsts = firsts
        self.lasts = lasts

    def __len__(self) -> int:
        return len(self.shards)

    @overload
    def __getitem__(self, index: int) -> Piece: ...
    @overload
    def __getitem__(self, index: slice) -> list[Piece]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        offset, nbytes = int(self.offsets[index]), int(self.nbytes[index])
        first = int(self.firsts[index])
        return Piece(int(self.shards[index]), memoryview(self.buffer)[offset:offset + nbytes],
                     None if first < 0 else (first, int(self.lasts[index])))


class _Stream:
    """Places the file's bytes, in order, into staging buffers; a full buffer is filled by
    the kernel and handed to the writers."""

    def __init__(self, writes: _Writes, fill: Fill) -> None:
        self._writes = writes
        self._fill = fill
        self._buffer = writes.take()
        self._held = True  # whether the buffer is this stream's, not yet handed to the writers
        self._capacity = len(self._buffer)
        self._start = 0  # file offset of the buffer's first byte (aligned)
        self._used = 0  # bytes placed in the buffer
        # the buffer's pieces so far, in runs: (shards, offsets, nbytes, firsts, lasts)
        self._pieces: list[tuple[np.ndarray, ...]] = []

    @property
    def position(self) -> int:
        """The file offset of the next byte to place."""
        return self._start + self._used

    def put(self, data: bytes) -> None:
        done = 0
        while done < len(data):
            count = min(len(data) - done, self._room())
            self._buffer[self._used:self._used + count] = data[done:done + count]
            self._used += count
            done += count

    def zeros(self, count: int) -> None:
        while count > 0:
            step = min(count, self._room())
            _zero(self._buffer, self._used, step)
            self._used += step
            count -= step

    def shards(self, spans: _Spans) -> None:
        """Place ``spans`` (in file order, from the position on): the ones that end in the
        buffer all at once, the zeros between them too; one that reaches past it in pieces."""
        done, count = 0, len(spans.offsets)
        ends = spans.offsets + spans.nbytes
        while done < count:
            self.zeros(int(spans.offsets[done]) - self.position)
            inside = int(np.searchsorted(ends, self._start + self._capacity, side="right"))
            if inside <= done:  # the next shard reaches past the buffer
                self._split(int(spans.shards[done]), int(spans.nbytes[done]),
                            int(spans.itemsizes[done]))
                done += 1
                continue
            offsets = spans.offsets[done:inside] - self._start
            gaps = np.flatnonzero(offsets[1:] > (offsets + spans.nbytes[done:inside])[:-1])
            for gap in gaps.tolist():  # zeros between shards
                end = int(offsets[gap] + spans.nbytes[done + gap])
                _zero(self._buffer, end, int(offsets[gap + 1]) - end)
            whole = np.full(inside - done, -1, np.int64)
            self._pieces.append((spans.shards[done:inside], offsets,
                                 spans.nbytes[done:inside], whole, whole))
            self._used = int(ends[inside - 1]) - self._start
            done = inside

    def _split(self, shard: int, nbytes: int, itemsize: int) -> None:
        """Place one shard in pieces of whole items, a buffer at a time."""
        elements = nbytes // itemsize
        done = 0
        while done < elements:
            count = min(elements - done, self._room() // itemsize)
            if count == 0:  # less than an item of room: the next buffer takes it
                self.flush()
                continue
            whole = done == 0 and count == elements
            self._pieces.append(tuple(np.array([n], np.int64) for n in (
                shard, self._used, count * itemsize, -1 if whole else done,
                -1 if whole else done + count)))
            self._used += count * itemsize
            done += count

    def _room(self) -> int:
        if self._used == self._capacity:
            self.flush()
        return self._capacity - self._used

    def flush(self, last: bool = False) -> None:
        """Fill the buffer's pieces, hand the buffer to the writers up to its last whole
        block (all of it, padded, when ``last``), and start the next with the rest."""
        if self._pieces:
            pieces = StagedPieces(self._buffer, *(np.concatenate(column)
                                                  for column in zip(*self._pieces)))
            self._pieces = []
            self._fill(pieces)
        end = self._used
        if last:
            aligned = -(-end // ALIGNMENT) * ALIGNMENT
            _zero(self._buffer, end, aligned - end)
            self._held = False
            if aligned:
                self._writes.submit(self._buffer, self._start, aligned)
            else:
                self._writes.give_back(self._buffer)
            return
        aligned = end - end % ALIGNMENT
        tail = bytes(self._buffer[aligned:end])
        self._held = False
        self._writes.submit(self._buffer, self._start, aligned)
        self._buffer = self._writes.take()
        self._held = True
        self._buffer[:len(tail)] = tail
        self._start += aligned
        self._used = len(tail)


    def abandon(self) -> None:
        """After a failure: the buffer being placed goes back to the free ones."""
        if self._held:
            self._held = False
            self._writes.give_back(self._buffer)


def _zero(buffer: mmap.mmap, start: int, count: int) -> None:
    if count > 0:
        buffer[start:start + count] = bytes(count)


class _Writes:
    """Writer threads taking filled buffers (file offset, length) and handing them back."""

    def __init__(self, fd: int, path: Path, direct: bool, buffers: StagingBuffers) -> None:
        self.fd = fd
        self.path = path
        self.direct = direct
        self._buffers = buffers
        self._todo: queue.SimpleQueue[tuple[mmap.mmap, int, int] | None] = queue.SimpleQueue()
        self._error: Exception | None = None
        self._switch = threading.Lock()
        self._threads = [threading.Thread(target=self._run, name=f"aoa-writer-{n}",
                                          daemon=True) for n in range(WRITERS)]
        for thread in self._threads:
            thread.start()

    def take(self) -> mmap.mmap:
        """A free buffer (waits for a write to finish); raises what a write raised."""
        buffer = self._buffers.take()
        if self._error is not None:
            self._buffers.free.put(buffer)
            self._check()
        return buffer

    def submit(self, buffer: mmap.mmap, offset: int, length: int) -> None:
        if self._error is not None:
            self.give_back(buffer)
            self._check()
        self._todo.put((buffer, offset, length))

    def give_back(self, buffer: mmap.mmap) -> None:
        """Return a buffer taken and not written (nothing to write, or a failure)."""
        self._buffers.free.put(buffer)

    def finish(self) -> None:
        """Wait for every write; raise what one raised."""
        self.stop()
        self._check()

    def _check(self) -> None:
        error = self._error
        if error is not None:
            why = error.strerror if isinstance(error, OSError) else repr(error)
            raise StorageError(f"{self.path}: cannot write: {why}") from error

    def _run(self) -> None:
        while True:
            job = self._todo.get()
            if job is None:
                return
            buffer, offset, length = job
            if self._error is None:
                try:
                    self._write(buffer, offset, length)
                except Exception as error:  # said by the filling thread, at its next step
                    self._error = error
            self._buffers.free.put(buffer)

    def _write(self, buffer: mmap.mmap, offset: int, length: int) -> None:
        view = memoryview(buffer)[:length]
        try:
            done = 0
            while done < length:
                direct = self.direct
                try:
                    done += os.pwrite(self.fd, view[done:], offset + done)
                except OSError as error:
                    if error.errno != errno.EINVAL or not direct:
                        raise  # refused through the page cache too: something else
                    self._leave_direct()
        finally:
            view.release()

    def _leave_direct(self) -> None:
        """After a direct write the file system refused: write through the page cache from
        now on (the other writer, refused at the same time, finds it done)."""
        with self._switch:
            if self.direct:
                flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~_O_DIRECT)
                self.direct = False

    def stop(self) -> None:
        """Wait for the writes handed over; stop the writer threads."""
        for _ in self._threads:
            self._todo.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []


def _open(path: Path, direct: bool) -> tuple[int, bool]:
    """The file opened for writing (made, emptied), direct where asked and possible."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    if direct and _O_DIRECT:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise StorageError(f"{path}: cannot write: {error.strerror}") from error
    try:
        return os.open(path, flags, 0o644), False
    except OSError as error:
        raise StorageError(f"{path}: cannot write: {error.strerror}") from error


def _reserve(fd: int, path: Path, size: int) -> None:
    """Allocate the file's blocks up front: a full disk is refused here, not mid-copy."""
    try:
        allocate(fd, size)
    except OSError as error:
        raise StorageError(f"{path}: cannot reserve {size} bytes: {error.strerror}") from error
