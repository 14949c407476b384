"""Dropping the pages of source bytes read once, a batch at a time."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from aoa.storage.pages import BATCH_BYTES, PageRelease

PAGE = mmap.PAGESIZE


class Recording:
    """Stands for a mapping: records each madvise."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def madvise(self, option: int, start: int, length: int) -> None:
        self.calls.append((option, start, length))


def test_small_releases_go_in_one_call_per_run_of_pages() -> None:
    mapping = Recording()
    pages = PageRelease(mapping)  # type: ignore[arg-type]
    size = 1000
    count = -(-BATCH_BYTES // size)  # the last release makes a batch
    for n in reversed(range(count - 1)):  # in any order: sorted before they are merged
        pages.release(10 + n * size, size)
    assert mapping.calls == []  # not a batch yet
    pages.release(10 + count * size + PAGE, size)  # past a gap of a page
    assert mapping.calls == [(mmap.MADV_DONTNEED, 0, 10 + (count - 1) * size),
                             (mmap.MADV_DONTNEED, (10 + count * size + PAGE) // PAGE * PAGE,
                              (10 + count * size + PAGE) % PAGE + size)]


def test_a_large_release_goes_at_once_and_empty_ones_never() -> None:
    mapping = Recording()
    pages = PageRelease(mapping)  # type: ignore[arg-type]
    pages.release(5 * PAGE, 0)
    pages.release(3 * PAGE + 1, BATCH_BYTES)
    assert mapping.calls == [(mmap.MADV_DONTNEED, 3 * PAGE, BATCH_BYTES + 1)]
    pages.release(PAGE, 10)
    pages.close()
    pages.flush()
    assert len(mapping.calls) == 1


def test_released_bytes_read_back_the_same(tmp_path: Path) -> None:
    path = tmp_path / "data"
    data = bytes(range(256)) * (3 * BATCH_BYTES // 256)
    path.write_bytes(data)
    with open(path, "rb") as file:
        mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    pages = PageRelease(mapping)
    for offset in range(0, len(data), 1 << 16):
        assert mapping[offset:offset + (1 << 16)] == data[offset:offset + (1 << 16)]
        pages.release(offset, 1 << 16)
    pages.flush()
    assert mapping[:] == data
    pages.close()
    mapping.close()


def test_many_releases_at_once_drop_what_one_by_one_drops() -> None:
    ranges = [(n * 3000 + 7, 2500 * (n % 3)) for n in reversed(range(2 * BATCH_BYTES // 3000))]
    one_by_one, at_once = Recording(), Recording()
    pages = PageRelease(one_by_one)  # type: ignore[arg-type]
    for offset, nbytes in ranges:
        pages.release(offset, nbytes)
    pages.flush()
    batch = PageRelease(at_once)  # type: ignore[arg-type]
    batch.release_many(ranges)
    batch.flush()
    def dropped(calls: list[tuple[int, int, int]]) -> set[int]:
        return {page for _, start, length in calls
                for page in range(start // PAGE, (start + length - 1) // PAGE + 1)}

    assert len(at_once.calls) <= len(one_by_one.calls)
    assert dropped(at_once.calls) == dropped(one_by_one.calls) != set()


def runs_one_by_one(ranges: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The calls a batch of (offset, nbytes) should make, worked out range by range."""
    runs: list[list[int]] = []
    for begin, end in sorted((offset, offset + nbytes) for offset, nbytes in ranges if nbytes):
        begin -= begin % PAGE
        if runs and begin <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([begin, end])
    return [(mmap.MADV_DONTNEED, begin, end - begin) for begin, end in runs]


#: Ranges in steps of a quarter page, so that they often end where a page begins.
QUARTERS = st.integers(0, 24).map(lambda n: n * PAGE // 4)


@given(st.lists(st.tuples(QUARTERS, QUARTERS), max_size=40))
def test_a_batch_drops_each_run_of_touching_pages_once(ranges: list[tuple[int, int]]) -> None:
    mapping = Recording()
    pages = PageRelease(mapping)  # type: ignore[arg-type]
    pages.release_many(ranges)
    pages.flush()
    assert mapping.calls == runs_one_by_one(ranges)


@given(st.lists(st.tuples(QUARTERS, QUARTERS), max_size=40), st.integers(0, 40))
def test_ranges_given_as_columns_drop_as_ranges_given_as_pairs(
        ranges: list[tuple[int, int]], split: int) -> None:
    """`release_columns` (numpy columns of offsets and bytes), alone or with pairs pending,
    drops the runs the same ranges given as pairs drop."""
    mapping = Recording()
    pages = PageRelease(mapping)  # type: ignore[arg-type]
    pages.release_many(ranges[:split])
    columns = np.array(ranges[split:], np.int64).reshape(-1, 2)
    pages.release_columns(columns[:, 0], columns[:, 1])
    pages.flush()
    assert mapping.calls == runs_one_by_one(ranges)
