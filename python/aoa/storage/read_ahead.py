"""Source bytes brought into the page cache ahead of the fills that read them.

A fill reads its sources through the files' mappings, in the order its copies go, and a
transpose reads a tensor a tile at a time, its rows far apart. From a file that is not in
the page cache each such touch is a fault that reads a page or a few (the kernel stops
reading around a mapping's faults once most of them miss): a cold conversion of the 1.55 GB
benchmark read at ~0.6 GB/s, then spent seconds on its last tensors page by page, where
``dd iflag=direct`` read the file at 1.5 GB/s (bench/README.md, goal 5).

`ReadAhead` reads the byte ranges the fills will need, in the order they will need them
and at most `WINDOW_BYTES` past the fill under way, `STREAMS` chunks at a time on threads of
its own, with ``sendfile`` into ``/dev/null``: the kernel's sequential read-ahead, in large
requests and large folios, with no copy into this process and nothing mapped in it, so the
resident size does not grow. Only files not already in the page cache are read ahead
(`_resident`: a few pages of each probed with ``RWF_NOWAIT``); a warm source costs nothing.
It is a hint and never fails a conversion: a file it cannot open or read is left to the
fills, which read it as before and say what is wrong with it. On Linux only; elsewhere the
fills read alone.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import numpy as np

#: How far (bytes of source ranges) reading ahead may run past the fill under way: a few
#: staging buffers' worth of sources, so that a whole fill's are in before it starts, while
#: a source larger than memory is not read so far ahead that its pages are evicted unread.
WINDOW_BYTES = 256 << 20
#: Reads in flight at once, each a thread of its own taking the next chunk in order. One
#: ``sendfile`` at a time keeps one read-ahead window of the kernel's in flight, and the
#: device serves several at once: the cold 1.55 GB benchmark source read at 1.0-1.7 GB/s by
#: one, 1.6-2.4 by four and 2.0-2.6 by eight (16 MiB chunks), while ``dd iflag=direct``
#: read it at 1.0-2.5 (bench/README.md, goal 5).
STREAMS = 8
#: Bytes of a chunk: one ``sendfile`` call, after which its thread looks for the end.
CHUNK_BYTES = 16 << 20
#: Ranges of one file this close are read as one (a few pages more, far fewer calls).
MERGE_GAP = 1 << 20
#: Pages of a file probed to tell whether it is in the page cache already.
PROBES = 64
#: Linux's ``sendfile`` takes any file as its output (elsewhere only a socket) and its
#: ``preadv`` answers ``RWF_NOWAIT``: other systems read as the fills ask.
_CAN_READ_AHEAD = sys.platform.startswith("linux") and hasattr(os, "RWF_NOWAIT")


class ReadAhead:
    """Reads ranges of ``paths`` into the page cache ahead of the fills, in the order they
    are `expect`-ed, no further than ``window`` bytes past the last mark `reached`, `STREAMS`
    reads at a time."""

    def __init__(self, paths: Sequence[Path], window: int = WINDOW_BYTES) -> None:
        self._paths = list(paths)
        #: whether each file is worth reading ahead: not in the page cache as it starts
        self._cold = [_CAN_READ_AHEAD and not _resident(path) for path in self._paths]
        self._window = window
        self._runs: deque[tuple[int, int, int, int]] = deque()  # (file, start, end, mark)
        self._queued = 0  # bytes of runs queued so far: each run's mark is where it ends
        self._reached = 0
        self._closed = False
        self._changed = threading.Condition()
        self._threads: list[threading.Thread] = []

    def expect(self, files: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray
               ) -> np.ndarray:
        """Queue ranges (file number, byte offset, bytes), in the order the fills will read
        them. Returns, for each, the mark that says the fills have reached it (`reached`);
        ranges of files that are in the page cache are not read, and take the mark before
        them."""
        marks = np.full(len(files), self._queued, np.int64)
        wanted = np.flatnonzero(np.array(self._cold, bool)[files] & (nbytes > 0))
        if not len(wanted):
            return marks
        runs_file, runs_start, runs_end, run_of = _merged(files[wanted], offsets[wanted],
                                                          offsets[wanted] + nbytes[wanted])
        ends = self._queued + np.cumsum(runs_end - runs_start)
        marks[wanted] = ends[run_of]
        marks = np.maximum.accumulate(marks)
        with self._changed:
            self._runs.extend(zip(runs_file.tolist(), runs_start.tolist(),
                                  runs_end.tolist(), ends.tolist()))
            self._queued = int(ends[-1])
            if not self._threads and not self._closed:
                self._threads = [threading.Thread(target=self._run, daemon=True,
                                                  name=f"aoa-read-ahead-{stream}")
                                 for stream in range(STREAMS)]
                for thread in self._threads:
                    thread.start()
            self._changed.notify_all()
        return marks

    @property
    def wanted(self) -> bool:
        """Whether any of the files is worth reading ahead (the rest cost nothing)."""
        return any(self._cold)

    def reached(self, mark: int) -> None:
        """The fills are at ``mark``: reading may run up to the window past it."""
        with self._changed:
            if mark > self._reached:
                self._reached = mark
                self._changed.notify_all()

    def close(self) -> None:
        """Stop reading ahead (the reads under way end first)."""
        with self._changed:
            self._closed = True
            self._runs.clear()
            self._changed.notify_all()
            threads = self._threads
        for thread in threads:
            thread.join()

    def _next_is_near(self) -> bool:
        """Whether a run is queued that begins within the window past the fills."""
        if not self._runs:
            return False
        _, start, end, mark = self._runs[0]
        return mark - (end - start) <= self._reached + self._window

    def _next_chunk(self) -> tuple[int, int, int] | None:
        """The next `CHUNK_BYTES` of the queued runs (file, start, end), once the fills are
        near enough; None once closed."""
        with self._changed:
            while not self._closed and not self._next_is_near():
                self._changed.wait()
            if self._closed:
                return None
            number, start, end, mark = self._runs[0]
            if end - start > CHUNK_BYTES:
                self._runs[0] = (number, start + CHUNK_BYTES, end, mark)
                return number, start, start + CHUNK_BYTES
            self._runs.popleft()
            return number, start, end

    def _run(self) -> None:
        """One stream: read chunk after chunk, in order, until `close`. A file it cannot
        open or read is read no more (`_unreadable`: the fills read it themselves, and say
        what is wrong). It holds one file open at a time (chunks come file after file), so a
        source of thousands of files costs no more descriptors than one."""
        number, fd = -1, -1
        try:
            sink = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            while (chunk := self._next_chunk()) is not None:
                try:
                    if chunk[0] != number:
                        if fd >= 0:
                            os.close(fd)
                            number, fd = -1, -1
                        fd = os.open(self._paths[chunk[0]], os.O_RDONLY | os.O_CLOEXEC)
                        number = chunk[0]
                    _, start, end = chunk
                    while start < end:
                        sent = os.sendfile(sink, fd, start, end - start)
                        if sent <= 0:  # the file ends sooner than it said: the fills say
                            break
                        start += sent
                except OSError:
                    self._unreadable(chunk[0])
        finally:
            if fd >= 0:
                os.close(fd)
            os.close(sink)

    def _unreadable(self, number: int) -> None:
        """File ``number`` is read ahead no more: its queued runs are dropped."""
        with self._changed:
            self._cold[number] = False
            self._runs = deque(run for run in self._runs if run[0] != number)
            self._changed.notify_all()


def _merged(files: np.ndarray, starts: np.ndarray, ends: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Consecutive ranges of one file that touch or nearly do (`MERGE_GAP`) as one run:
    each run's file, start and end, and the run of each range."""
    new = np.ones(len(files), bool)
    new[1:] = ((files[1:] != files[:-1]) | (starts[1:] - ends[:-1] > MERGE_GAP)
               | (starts[1:] < starts[:-1]))  # a run's starts only grow
    run_of = np.cumsum(new) - 1
    firsts = np.flatnonzero(new)
    return files[firsts], starts[firsts], np.maximum.reduceat(ends, firsts), run_of


def _resident(path: Path) -> bool:
    """Whether ``path`` looks wholly in the page cache: `PROBES` pages spread over it are
    (``preadv`` with ``RWF_NOWAIT`` answers at once, a page it lacks at most starting a
    small read of it). False where it cannot tell (Linux only)."""
    page = bytearray(1)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True  # nothing to read ahead: the fills say what is wrong
    try:
        size = os.fstat(fd).st_size
        for offset in np.linspace(0, max(size - 1, 0), PROBES, dtype=np.int64).tolist():
            with contextlib.suppress(BlockingIOError):
                if os.preadv(fd, [page], offset, os.RWF_NOWAIT) > 0 or not size:
                    continue
            return False
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
