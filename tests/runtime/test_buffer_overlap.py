"""`runtime.buffers.overlapping`: which of a load's buffers share memory, by address alone
(nothing is read, so GPU buffers are described as they are: no GPU is needed here)."""

from __future__ import annotations

import numpy as np

from aoa.runtime.buffers import DeviceBuffer, adapt, overlapping


def device(pointer: int, rows: int, index: int = 0) -> DeviceBuffer:
    """A [rows, 4] float32 buffer at ``pointer`` on CUDA device ``index``."""
    return DeviceBuffer((rows, 4), "float32", pointer, index, "test", None,
                        (f"cuda:{index}", pointer, (16, 4)))


def test_one_address_on_two_devices_is_two_memories():
    assert overlapping([device(1 << 20, 4, 0), device(1 << 20, 4, 1)], ["a", "b"]) is None


def test_ranges_that_meet_on_one_device_overlap_and_ranges_that_touch_do_not():
    base = 1 << 20
    assert overlapping([device(base, 4), device(base + 48, 4)], ["a", "b"]) == (0, 1)
    assert overlapping([device(base, 4), device(base + 64, 4)], ["a", "b"]) is None


def test_the_first_pair_found_is_given_in_the_callers_order():
    base = 1 << 20
    buffers = [device(base + 1024, 2), device(base, 4), device(base + 1040, 1)]
    assert overlapping(buffers, ["a", "b", "c"]) == (0, 2)


def test_one_destination_given_twice_is_filled_alike_but_two_are_not():
    base = 1 << 20
    assert overlapping([device(base, 4), device(base, 4)], ["a", "a"]) is None
    assert overlapping([device(base, 4), device(base, 4)], ["a", "b"]) == (0, 1)


def test_a_buffer_of_no_element_shares_nothing():
    empty = DeviceBuffer((0, 4), "float32", 1 << 20, 0, "test", None, ("cuda:0", 1 << 20,
                                                                         (16, 4)))
    assert overlapping([empty, device(1 << 20, 4)], ["a", "b"]) is None


def test_strided_views_are_told_apart_element_by_element():
    rows = np.zeros((6, 8), np.float32)
    backwards = rows[::-1, ::2]  # negative strides: its range starts below its address
    pairs = {"interleaved": (rows[:, ::2], rows[:, 1::2]), "backwards": (backwards, rows[:, 2:6])}
    found = {name: overlapping([adapt(a, "a"), adapt(b, "b")], ["a", "b"])
             for name, (a, b) in pairs.items()}
    assert found == {"interleaved": None, "backwards": (0, 1)}
    assert np.shares_memory(*pairs["backwards"]) and not np.shares_memory(*pairs["interleaved"])
