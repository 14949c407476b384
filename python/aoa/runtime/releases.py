"""When to drop the pages of the source shards a fill read: after the last fill that reads
each one, or sooner, all together, once those kept for later fills pass `HELD_BYTES`.

Dropping every shard a fill read right after it (what memory alone asks) costs a system
call per shard, and the shards that a later fill reads again (TP2 -> TP4: each source shard
goes into two ranks' files) are faulted back in from the page cache, page by page. With
tens of thousands of small tensors that was a third of writing them
(`bench/small_tensors.py`); kept until their last read, each is dropped once, while memory
stays bounded by the staging buffers plus `HELD_BYTES`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from aoa.layout import shards_nbytes
from aoa.plan import Plan
from aoa.runtime.kernel_table import PlanTable

#: Bytes of source shards kept mapped for later fills before they are all dropped at once.
HELD_BYTES = 128 << 20


class SourceReleases:
    """Counts, per source shard of a plan, the copies still to run from it; tells
    ``release`` (once per fill, with every shard at once) which shards to drop."""

    def __init__(self, table: PlanTable, plan: Plan,
                 release: Callable[[list[int]], None]) -> None:
        self._table = table
        self._sources = plan.sources
        self._destinations = plan.destinations
        self._release = release
        self._remaining = np.bincount(table.sources_read(np.arange(len(table.order)))[0],
                                      minlength=len(plan.sources))
        self._held = np.zeros(len(plan.sources), np.int64)  # bytes kept of each, 0: none
        self._held_bytes = 0
        self._elements_left: dict[int, int] = {}  # shards filled in part so far

    @functools.cached_property
    def _nbytes(self) -> np.ndarray:
        """Each source shard's bytes, for fills that do not say those of the shards they
        read (worked out on first use: 63k shards' take 14 ms, before the first write)."""
        return np.array(shards_nbytes(self._sources), np.int64)

    def filled(self, shards: np.ndarray, firsts: np.ndarray, lasts: np.ndarray,
               read: np.ndarray, read_nbytes: np.ndarray | None = None,
               reads: np.ndarray | None = None) -> None:
        """After a fill of destination ``shards`` (elements [firsts, lasts), whole where
        -1) that read the source shards ``read`` (distinct), ``read_nbytes`` bytes each
        where the fill knows them (its source windows); ``reads``: how often the whole
        pieces' records read each of ``read``, where the fill counted them (those records
        are the table's rows of these shards, read for read: counted here, they would be
        looked up again)."""
        if reads is None:
            self._count_complete(shards, firsts, lasts)
        else:
            self._remaining[read] -= reads
            parts = firsts >= 0
            if parts.any():
                self._count_complete(shards[parts], firsts[parts], lasts[parts])
        done = self._remaining[read] <= 0
        dropped = read[done]
        kept = read[~done]
        fresh = self._held[kept] == 0
        new = kept[fresh]
        nbytes = self._nbytes[new] if read_nbytes is None else read_nbytes[~done][fresh]
        self._held[new] = np.maximum(nbytes, 1)  # at least 1: a shard kept counts as held
        self._held_bytes += int(self._held[new].sum()) - int(self._held[dropped].sum())
        self._held[dropped] = 0
        if self._held_bytes > HELD_BYTES:
            dropped = np.concatenate([dropped, np.flatnonzero(self._held)])
            self._held[:] = 0
            self._held_bytes = 0
        if len(dropped):
            self._release(dropped.tolist())

    def _count_complete(self, shards: np.ndarray, firsts: np.ndarray, lasts: np.ndarray
                        ) -> None:
        """Take the reads of the shards now complete off the counts: the whole ones, and
        those whose last part was just filled."""
        complete = [shards[firsts < 0]]
        for shard, first, last in zip(*(a[firsts >= 0].tolist() for a in (shards, firsts,
                                                                          lasts))):
            left = self._elements_left.get(shard)
            if left is None:
                left = math.prod(self._destinations[shard].local_shape)
            left -= last - first
            self._elements_left[shard] = left
            if left <= 0:
                del self._elements_left[shard]
                complete.append(np.array([shard], np.int64))
        shards = np.concatenate(complete)
        if not len(shards):
            return
        rows, _ = self._table.rows(shards)
        self._remaining -= np.bincount(self._table.sources_read(rows)[0],
                                      minlength=len(self._sources))
