"""The kernel table (`aoa.runtime.kernel_table`): records read back as the copies packed, a
whole plan lowered by blocks as copy by copy, and the executor filling pieces staged in one
buffer (`StagedPieces`, each piece a window of it) with the reference's bytes, both backends."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
from sharding import sharded

import aoa
from aoa.errors import ExecutionError
from aoa.plan import CopyTable, Plan
from aoa.runtime import cpp_backend, reference
from aoa.runtime.copies import BlockScale, Copy
from aoa.runtime.executor import PlanExecutor
from aoa.runtime.kernel_table import PlanTable, Records, pack, pack_records, ranges, unpack
from aoa.runtime.lower import kernel_copies
from aoa.storage.writer import StagedPieces

PROGRAM = ["w.$LAYER_ID^T -> v.$LAYER_ID, dtype='bfloat16'", "b -> c, dtype='float32'"]


def layered_plan() -> tuple[Plan, dict[str, np.ndarray]]:
    """Three layers laid out alike (one shared block), a key of its own; and the tensors."""
    source = {f"w.{i}": sharded(f"w.{i}", (4, 6), 2, 0) for i in range(3)}
    source["b"] = sharded("b", (6, 8), 4, 1, "float16")
    destination = {f"v.{i}": sharded(f"v.{i}", (6, 4), 2, 1, "bfloat16") for i in range(3)}
    destination["c"] = sharded("c", (6, 8), 2, 0, "float32")
    rng = np.random.default_rng(5)
    tensors = {f"w.{i}": rng.standard_normal((4, 6), dtype=np.float32) for i in range(3)}
    tensors["b"] = rng.standard_normal((6, 8)).astype(np.float16)
    return aoa.compile(PROGRAM, source, destination), tensors


def test_records_read_back_as_the_copies_packed():
    copies = [Copy(0, 8, (16, 4), 1, 0, (4, 16), (3, 4), "float32", "bfloat16", ("float16",)),
              Copy(1, 0, (2,), 0, 6, (2,), (5,), "bfloat16", "bfloat16"),
              Copy(0, 0, (), 0, 0, (), (), "int8", "int8"),
              Copy(2, 4, (8, 2), 0, 0, (8, 2), (2, 2), "float8_e4m3fn", "bfloat16", (),
                   BlockScale(3, 0, (4, 4), (128, 128), (1, 5), "float32"))]
    assert unpack(pack(copies)) == copies


def test_ranges_are_the_integers_of_each_in_turn():
    starts, counts = np.array([5, 0, 9, 2]), np.array([3, 0, 1, 2])
    assert ranges(starts, counts).tolist() == [5, 6, 7, 9, 2, 3]
    assert ranges(starts[:0], counts[:0]).tolist() == []


def test_a_plan_lowered_by_blocks_is_the_plan_lowered_copy_by_copy():
    plan, _ = layered_plan()
    assert isinstance(plan.copies, CopyTable)
    by_block = PlanTable(plan)
    each = PlanTable(Plan(plan.sources, plan.destinations, list(plan.copies)))
    # in destination order: the rows of every destination shard, one after another
    every = np.arange(len(plan.destinations))
    by_block_records = by_block.lowered.take(by_block.rows(every)[0])
    each_records = each.lowered.take(each.rows(every)[0])
    assert by_block_records.table.tolist() == each_records.table.tolist()
    assert by_block_records.starts.tolist() == each_records.starts.tolist()
    assert by_block.firsts.tolist() == each.firsts.tolist()
    # grouped by destination, each destination's in plan order
    lowered = kernel_copies(plan)
    order = sorted(range(len(lowered)), key=lambda i: (lowered[i].destination, i))
    assert unpack(by_block_records.table) == [lowered[i] for i in order]
    assert by_block.plan_copies.tolist() == order


def test_records_taken_keep_their_scale_fields():
    scaled = Copy(1, 0, (2,), 0, 0, (2,), (2,), "float8_e4m3fn", "float32", (),
                  BlockScale(2, 0, (4,), (128,), (0,), "float32"))
    plain = Copy(0, 0, (1,), 0, 0, (1,), (1,), "int8", "int8")
    records = Records(*pack_records([plain, scaled]))
    # the plain record: 7 fields, ndim, shape and two strides, has_scale; then the scaled
    # one has as many before its has_scale, then its scale source
    assert records.scales.tolist() == [-1, 12 + 12]
    taken = Records.join([records.take(np.array([1])), records.take(np.array([0, 1]))])
    assert unpack(taken.table) == [scaled, plain, scaled]
    assert taken.table[taken.scales[taken.scales >= 0]].tolist() == [2, 2]


def staged(plan: Plan, order: list[int], buffer: mmap.mmap, cut: int | None = None
           ) -> StagedPieces:
    """Destination shards ``order`` back to back in ``buffer`` (4 bytes apart), the last
    one cut at element ``cut`` (its first elements only)."""
    shards, offsets, nbytes, firsts, lasts = [], [], [], [], []
    at = 0
    for n, index in enumerate(order):
        shard = plan.destinations[index]
        part = shard.nbytes
        first = last = -1
        if cut is not None and n == len(order) - 1:
            part = cut * shard.nbytes // int(np.prod(shard.local_shape))
            first, last = 0, cut
        shards.append(index)
        offsets.append(at)
        nbytes.append(part)
        firsts.append(first)
        lasts.append(last)
        at += part + 4
    return StagedPieces(buffer, *(np.array(column, np.int64)
                                  for column in (shards, offsets, nbytes, firsts, lasts)))


@pytest.mark.parametrize("backend", ["cpp", "numpy"])
@pytest.mark.parametrize("cut", [None, 5])
def test_pieces_staged_in_one_buffer_fill_what_the_reference_fills(backend, cut):
    plan, tensors = layered_plan()
    want = reference.run_plan_on_arrays(plan, tensors)
    sources = [np.ascontiguousarray(tensors[s.key][tuple(slice(o, o + n) for o, n in zip(
        s.global_offset, s.local_shape))]) for s in plan.sources]
    executor = PlanExecutor(plan, sources.__getitem__, backend=backend)
    order = list(range(len(plan.destinations)))[::-1]
    buffer = mmap.mmap(-1, 4096)
    buffer[:] = b"\xab" * 4096
    pieces = staged(plan, order, buffer, cut)
    executor.fill(pieces)
    for piece, offset in zip(pieces, pieces.offsets.tolist()):
        expected = want[piece.shard].tobytes()
        if piece.elements is not None:
            expected = expected[:len(piece.buffer)]  # type: ignore[arg-type]
        assert bytes(piece.buffer) == expected  # type: ignore[call-overload]
        assert buffer[offset + len(expected):offset + len(expected) + 4] == b"\xab" * 4


@pytest.mark.parametrize("backend", ["cpp", "numpy"])
def test_source_windows_read_what_buffers_of_their_own_read(backend):
    """An executor given a source's windows (a few buffers, a range of one per source
    shard) fills what it fills from a buffer per shard."""
    plan, tensors = layered_plan()
    want = reference.run_plan_on_arrays(plan, tensors)
    sources = [np.ascontiguousarray(tensors[s.key][tuple(slice(o, o + n) for o, n in zip(
        s.global_offset, s.local_shape))]) for s in plan.sources]
    whole = b"\xee" * 3 + b"".join(source.tobytes() for source in sources)  # one "file"
    starts = np.cumsum([3] + [source.nbytes for source in sources])

    def windows(indices: np.ndarray) -> tuple[list[bytes], np.ndarray]:
        return [b"", whole], np.stack([np.ones_like(indices), starts[indices],
                                       starts[indices + 1] - starts[indices]], axis=1)

    executor = PlanExecutor(plan, lambda index: pytest.fail("a buffer asked per shard"),
                            backend=backend, source_windows=windows)
    buffer = mmap.mmap(-1, 4096)
    pieces = staged(plan, list(range(len(plan.destinations))), buffer, None)
    executor.fill(pieces)
    for piece in pieces:
        assert bytes(piece.buffer) == want[piece.shard].tobytes()  # type: ignore[call-overload]


def test_a_source_window_is_checked_to_lie_inside_its_buffer():
    copy = Copy(0, 0, (1,), 0, 0, (1,), (4,), "uint8", "uint8")
    with pytest.raises(ExecutionError) as caught:
        cpp_backend.execute_table(pack([copy]), [bytes(4)], [bytearray(4)], 1, None,
                                  np.array([[0, 1, 4]], np.int64))
    assert caught.value.message == ("source window 0 (buffer 0, offset 1, 4 bytes) does not "
                                    "lie inside a source buffer")
    with pytest.raises(ExecutionError) as caught:  # a copy past its window, inside the buffer
        cpp_backend.execute_table(pack([copy]), [bytes(8)], [bytearray(4)], 1, None,
                                  np.array([[0, 2, 3]], np.int64))
    assert caught.value.message.startswith("copy 0: source region (offset 0, shape (4,)")
    destination = bytearray(4)
    cpp_backend.execute_table(pack([copy]), [b"abcdefgh"], [destination], 1, None,
                              np.array([[0, 3, 4]], np.int64))
    assert destination == b"defg"


def test_a_window_is_checked_to_lie_inside_its_buffer():
    copy = Copy(0, 0, (1,), 0, 0, (1,), (4,), "uint8", "uint8")
    destination = bytearray(8)
    with pytest.raises(ExecutionError) as caught:
        cpp_backend.execute_table(pack([copy]), [bytes(4)], [destination], 1,
                                  np.array([[0, 6, 4]], np.int64))
    assert caught.value.message == ("window 0 (buffer 0, offset 6, 4 bytes) does not lie inside "
                                 "a destination buffer")
    with pytest.raises(ExecutionError) as caught:  # a copy past its window, inside the buffer
        cpp_backend.execute_table(pack([copy]), [bytes(4)], [destination], 1,
                                  np.array([[0, 2, 3]], np.int64))
    assert caught.value.message == ("copy 0: destination region (offset 0, shape (4,), strides "
                                 "(1,)) does not fit in destination 0 of 3 bytes")
    assert destination == bytearray(8)
    cpp_backend.execute_table(pack([copy]), [b"\x01\x02\x03\x04"], [destination], 1,
                              np.array([[0, 2, 4]], np.int64))
    assert destination == bytearray(b"\0\0\x01\x02\x03\x04\0\0")
