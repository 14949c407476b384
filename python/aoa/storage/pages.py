"""Pages of a read-only file mapping that a reader is done with, dropped from the process's
memory in batches (they stay in the page cache, and come back on the next read).

A conversion drops the pages of each source shard once it has read it, so that its resident
size stays near what it writes, not everything it has read. One ``madvise`` per shard costs
a system call per tensor, 126k of them for a checkpoint of 31k small tensors read twice;
here the ranges pile up until they hold `BATCH_BYTES`, then go with one call per run of
adjacent pages (the shards of a file are mostly read in file order).
"""

from __future__ import annotations

import contextlib
import mmap
import operator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when pages are first dropped: reading headers needs no numpy
    import numpy as np

#: Bytes of released ranges held back before their pages are dropped (per mapping).
BATCH_BYTES = 4 << 20
#: Whether this system can drop a mapping's pages (Linux, macOS).
_CAN_DROP = hasattr(mmap, "MADV_DONTNEED")
_NBYTES = operator.itemgetter(1)


class PageRelease:
    """Drops the pages of released byte ranges of ``mapping``, a batch at a time."""

    def __init__(self, mapping: mmap.mmap | None) -> None:
        self._mapping = mapping
        self._ranges: list[tuple[int, int]] = []  # (offset, nbytes)
        self._columns: list[np.ndarray] = []  # (n, 2) arrays of (offset, nbytes)
        self._pending = 0

    def release(self, offset: int, nbytes: int) -> None:
        """Drop the pages of bytes [offset, offset + nbytes) (those they share with other
        bytes too) once `BATCH_BYTES` are pending."""
        if self._mapping is None or not nbytes or not _CAN_DROP:
            return
        self._ranges.append((offset, nbytes))
        self._pending += nbytes
        if self._pending >= BATCH_BYTES:
            self.flush()

    def release_many(self, ranges: list[tuple[int, int]]) -> None:
        """`release` of each (offset, nbytes), the batch checked once at the end."""
        if self._mapping is None or not _CAN_DROP:
            return
        self._ranges += ranges
        self._pending += sum(map(_NBYTES, ranges))
        if self._pending >= BATCH_BYTES:
            self.flush()

    def release_columns(self, offsets: np.ndarray, nbytes: np.ndarray) -> None:
        """`release_many` of ranges given as two int64 columns (no Python work per range:
        a fill of a checkpoint of small tensors releases thousands at once)."""
        import numpy as np

        if self._mapping is None or not _CAN_DROP or not len(offsets):
            return
        self._columns.append(np.column_stack((offsets, nbytes)))
        self._pending += int(nbytes.sum())
        if self._pending >= BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Drop the pages of every pending range now, one call per run of ranges that
        overlap or touch once each begins at its page (worked out with numpy: a batch holds
        tens of thousands of small tensors)."""
        import numpy as np

        ranges, columns = self._ranges, self._columns
        self._ranges, self._columns, self._pending = [], [], 0
        if ranges:
            columns.append(np.array(ranges, dtype=np.int64))
        if not columns:
            return
        pairs = np.concatenate(columns)
        pairs = pairs[pairs[:, 1] > 0]
        if not len(pairs):
            return
        pairs = pairs[np.argsort(pairs[:, 0], kind="stable")]
        begins = pairs[:, 0] - pairs[:, 0] % mmap.PAGESIZE
        reach = np.maximum.accumulate(pairs[:, 0] + pairs[:, 1])  # the furthest end so far
        firsts = np.flatnonzero(np.concatenate(([True], begins[1:] > reach[:-1])))
        lasts = np.append(firsts[1:] - 1, len(begins) - 1)
        for begin, end in zip(begins[firsts].tolist(), reach[lasts].tolist()):
            if self._mapping is None:
                return
            with contextlib.suppress(OSError, ValueError):  # a mapping closed under us
                self._mapping.madvise(mmap.MADV_DONTNEED, begin, end - begin)

    def close(self) -> None:
        """Forget the pending ranges: the mapping is going."""
        self._mapping = None
        self._ranges, self._columns, self._pending = [], [], 0
