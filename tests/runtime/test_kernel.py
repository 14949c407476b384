"""The C++ kernel against the numpy reference, byte for byte.

Destinations start as the same random bytes for both backends, so a byte written where it
should not be shows as well as a wrong value. Sources are random bytes: NaN payloads,
infinities and subnormals come up in every float dtype.
"""

from __future__ import annotations

import mmap

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aoa import _core
from aoa.dtypes import FLOATING, NUMPY_DTYPES, itemsize
from aoa.errors import ExecutionError, UsageError
from aoa.runtime import cpp_backend, numpy_backend
from aoa.runtime.copies import Copy

DTYPES = tuple(NUMPY_DTYPES)
INTEGERS = sorted(numpy_backend.INTEGERS)
#: Every supported (source, destination) pair of one step.
CASTS = [(s, d) for s in DTYPES for d in DTYPES if numpy_backend.cast_refusal(s, d) is None]


def run_both(copies, sources, destinations, threads=1):
    """Run both backends on copies of ``destinations``; assert the same bytes; return them."""
    expected = [bytearray(d) for d in destinations]
    numpy_backend.execute_copies(copies, sources, expected)
    actual = [bytearray(d) for d in destinations]
    cpp_backend.execute_copies(copies, sources, actual, threads=threads)
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        assert got == want, f"destination {index} differs"
    return actual


def refusals(copies, sources, destinations):
    """Both backends' ExecutionError messages; asserts that no byte was written."""
    messages = []
    for execute in (numpy_backend.execute_copies, cpp_backend.execute_copies):
        written = [bytearray(d) for d in destinations]
        with pytest.raises(ExecutionError) as error:
            execute(copies, sources, written)
        assert written == [bytearray(d) for d in destinations]
        messages.append(str(error.value))
    return messages


def random_bytes(seed: int, size: int) -> bytes:
    """Any bytes, bools too (any nonzero byte is true in both backends)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


# --- layouts -------------------------------------------------------------------------


@st.composite
def shapes(draw, max_ndim=5, max_extent=5):
    shape = draw(st.lists(st.integers(1, max_extent), max_size=max_ndim))
    if shape and draw(st.integers(0, 9)) == 0:
        shape[draw(st.integers(0, len(shape) - 1))] = 0
    return tuple(shape)


@st.composite
def regions(draw, shape, item, broadcast=False):
    """(offset, strides, buffer size) of ``shape`` inside a padded tensor with axes in any
    memory order, some flipped (negative strides), some broadcast (zero strides)."""
    ndim = len(shape)
    order = draw(st.permutations(range(ndim)))
    padded = [extent + draw(st.integers(0, 2)) for extent in shape]
    stride = item * draw(st.sampled_from([1, 1, 1, 2]))
    strides = [0] * ndim
    for axis in reversed(order):
        strides[axis] = stride
        stride *= padded[axis]
    lead = draw(st.integers(0, 2 * item))  # unaligned offsets too
    offset = lead + sum(
        draw(st.integers(0, p - e)) * s for p, e, s in zip(padded, shape, strides, strict=True)
    )
    for axis in range(ndim):
        if broadcast and draw(st.integers(0, 7)) == 0:
            strides[axis] = 0
        elif draw(st.integers(0, 3)) == 0:
            offset += (shape[axis] - 1) * strides[axis] if shape[axis] else 0
            strides[axis] = -strides[axis]
    size = lead + stride + draw(st.integers(0, item))
    return offset, tuple(strides), size


@st.composite
def casts(draw):
    source, destination = draw(st.sampled_from(CASTS))
    via = ()
    if destination in FLOATING:
        via = tuple(draw(st.lists(st.sampled_from(sorted(FLOATING)), max_size=2)))
    return source, destination, via


@st.composite
def calls(draw, max_copies=4, max_extent=5):
    """A kernel call: copies, each with its own source and destination buffer."""
    count = draw(st.integers(1, max_copies))
    source_slots = draw(st.permutations(range(count)))
    destination_slots = draw(st.permutations(range(count)))
    copies, sources, destinations = [], [None] * count, [None] * count
    for k in range(count):
        source_dtype, destination_dtype, via = draw(casts())
        shape = draw(shapes(max_extent=max_extent))
        s_offset, s_strides, s_size = draw(regions(shape, itemsize(source_dtype), broadcast=True))
        d_offset, d_strides, d_size = draw(regions(shape, itemsize(destination_dtype)))
        seed = draw(st.integers(0, 2**32 - 1))
        sources[source_slots[k]] = random_bytes(seed, s_size)
        destinations[destination_slots[k]] = random_bytes(seed + 1, d_size)
        copies.append(Copy(source_slots[k], s_offset, s_strides, destination_slots[k], d_offset,
                           d_strides, shape, source_dtype, destination_dtype, via))
    return copies, sources, destinations


# --- same bytes as the reference ---------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(calls(), st.integers(1, 4))
def test_copies_match_the_reference(call, threads):
    run_both(*call, threads=threads)


@settings(max_examples=12, deadline=None)
@given(st.data(), st.integers(1, 4))
def test_large_permuted_copies_match_across_threads(data, threads):
    # Large enough to be cut over threads and to span several 64 x 64 tiles.
    ndim = data.draw(st.integers(2, 3))
    extents = st.integers(40, 140) if ndim == 2 else st.integers(20, 70)
    shape = tuple(data.draw(st.lists(extents, min_size=ndim, max_size=ndim)))
    source_dtype, destination_dtype, via = data.draw(casts())
    permutation = data.draw(st.permutations(range(ndim)))
    source_shape = tuple(shape[k] for k in permutation)
    contiguous = _contiguous_strides(source_shape, itemsize(source_dtype))
    source_strides = dict(zip(permutation, contiguous, strict=True))
    elements = int(np.prod(shape))
    copy = Copy(0, 0, tuple(source_strides[k] for k in range(ndim)), 0, 0,
                _contiguous_strides(shape, itemsize(destination_dtype)),
                shape, source_dtype, destination_dtype, via)
    sources = [random_bytes(1, elements * itemsize(source_dtype))]
    run_both([copy], sources, [bytes(elements * itemsize(destination_dtype))], threads=threads)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from(["uint8", "bfloat16", "float32", "float64"]),
       st.integers(1, 3))
def test_short_contiguous_rows_match_the_reference(data, dtype, threads):
    """Plain copies of rows contiguous on both sides and strided between them (each row a
    fixed-size copy where it is 8, 16, 32 or 64 bytes), with outer axes around them."""
    item = itemsize(dtype)
    columns = data.draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16, 24, 32, 64]))
    outer = tuple(data.draw(st.lists(st.integers(1, 4), max_size=2)))
    shape = (*outer, data.draw(st.integers(1, 70)), columns)
    buffers, strides = [], []
    for _ in range(2):  # source, then destination: rows padded apart, axes maybe permuted
        row = (columns + data.draw(st.integers(1, 3))) * item
        extents = [shape[-2], *reversed(outer)]
        order = data.draw(st.permutations(range(len(extents))))
        step, placed = row, [0] * len(extents)
        for k in order:
            placed[k] = step
            step *= extents[k]
        strides.append((*reversed(placed[1:]), placed[0], item))
        buffers.append(random_bytes(data.draw(st.integers(0, 2**32 - 1)), step))
    copy = Copy(0, 0, strides[0], 0, 0, strides[1], shape, dtype, dtype)
    run_both([copy], buffers[:1], buffers[1:], threads=threads)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "uint8"])
@pytest.mark.parametrize(
    ("shape", "permutation"),
    [((67, 131), (1, 0)), ((600, 513), (1, 0)), ((5, 70, 33), (2, 0, 1)), ((9, 8, 130), (2, 1, 0))],
)
def test_transposes_match_the_reference(dtype, shape, permutation):
    # Exact transposes go through whole SSE2 blocks; edges through rows.
    item = itemsize(dtype)
    source_shape = tuple(shape[k] for k in permutation)
    source_strides = dict(zip(permutation, _contiguous_strides(source_shape, item), strict=True))
    copy = Copy(0, 0, tuple(source_strides[k] for k in range(len(shape))), 0, 0,
                _contiguous_strides(shape, item), shape, dtype, dtype)
    size = int(np.prod(shape)) * item
    for threads in (1, 3):
        run_both([copy], [random_bytes(6, size)], [bytes(size)], threads=threads)


def _contiguous_strides(shape, item):
    return tuple(int(s) for s in np.cumprod((1, *shape[:0:-1]))[::-1] * item)


#: Extents just below, at and above the AVX2 block sides (4, 8, 16 rows; 8, 16, 32 columns)
#: and the 128-item tile.
NEAR_BLOCKS = (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 131)


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from(["uint8", "bfloat16", "int16", "float32", "float64"]),
       st.integers(1, 3))
def test_transposes_near_block_edges_match_the_reference(data, dtype, threads):
    # Outer axes in any order, the last two swapped: an exact transpose of the inner pair.
    # Source lines and destination rows padded by a few items, and offsets that break
    # every alignment.
    item = itemsize(dtype)
    outer = data.draw(st.lists(st.integers(1, 3), max_size=3))
    shape = (*outer, data.draw(st.sampled_from(NEAR_BLOCKS)),
             data.draw(st.sampled_from(NEAR_BLOCKS)))
    ndim = len(shape)
    order = [*data.draw(st.permutations(range(ndim - 2))), ndim - 1, ndim - 2]
    strides, stride = [0] * ndim, item
    for k, axis in enumerate(reversed(order)):
        strides[axis] = stride
        stride *= shape[axis] + (data.draw(st.integers(0, 3)) if k == 0 else 0)
    source_offset = data.draw(st.integers(0, 2 * item))
    row = (shape[-1] + data.draw(st.integers(0, 3))) * item
    destination_strides = (*_contiguous_strides((*shape[:-1], row // item), item)[:-2], row,
                           item)
    destination_offset = data.draw(st.integers(0, 64))
    destination_size = destination_offset + int(np.prod(shape[:-1])) * row
    copy = Copy(0, source_offset, tuple(strides), 0, destination_offset, destination_strides,
                shape, dtype, dtype)
    run_both([copy], [random_bytes(7, source_offset + stride)],
             [random_bytes(8, destination_size)], threads=threads)


@pytest.mark.parametrize(("dtype", "destination_offset", "row_bytes", "rows", "short", "seed"), [
    # Over 16 MiB of destination, rows 8 KiB apart: streamed stores, the columns before the
    # first 64-byte line through rows (none when the offset is not a multiple of the item).
    *[(dtype, offset, 8192, 2053, 3, 9) for dtype in ("float64", "float32", "bfloat16", "uint8")
      for offset in (0, 16, 40, 2)],
    # 1-16 MiB of destination (a piece of a staging buffer), rows 4 KiB apart: streamed
    # stores too, in tiles taller than the copy (fewer rows than a streamed tile's 1024).
    *[(dtype, offset, 4096, 517, 5, 13) for dtype in ("float64", "float32", "bfloat16")
      for offset in (0, 40)],
])
def test_large_transposes_match_the_reference(dtype, destination_offset, row_bytes, rows,
                                              short, seed):
    # ``short``: columns fewer than a destination row holds, so each row ends mid-line.
    item = itemsize(dtype)
    columns = row_bytes // item - short
    copy = Copy(0, 0, (item, rows * item), 0, destination_offset, (row_bytes, item),
                (rows, columns), dtype, dtype)
    run_both([copy], [random_bytes(seed, rows * columns * item)],
             [random_bytes(seed + 1, destination_offset + rows * row_bytes)],
             threads=1 + destination_offset % 3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_large_batched_transposes_match_the_reference(dtype):
    item = itemsize(dtype)
    batch, rows, columns = 2, 1031, 8192 // item - 1
    copy = Copy(0, 0, (rows * columns * item, item, rows * item), 0, 16,
                (rows * 8192, 8192, item), (batch, rows, columns), dtype, dtype)
    run_both([copy], [random_bytes(11, batch * rows * columns * item)],
             [random_bytes(12, 16 + batch * rows * 8192)], threads=2)


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_many_small_copies_are_shared_over_threads(threads):
    # 600 rows of 256 float32 into bfloat16, each its own copy, reversed in order.
    rows, width = 600, 256
    copies = [
        Copy(0, row * width * 4, (4,), 0, (rows - 1 - row) * width * 2, (2,), (width,),
             "float32", "bfloat16")
        for row in range(rows)
    ]
    run_both(copies, [random_bytes(2, rows * width * 4)], [bytes(rows * width * 2)],
             threads=threads)


def test_a_long_cast_chain_runs_in_blocks():
    copy = Copy(0, 0, (4,), 0, 0, (8,), (5000,), "float32", "float64", ("bfloat16", "float16"))
    run_both([copy], [random_bytes(3, 20000)], [bytes(40000)])


def test_copies_beyond_the_inline_axes_and_steps_match_the_reference():
    # more axes (6, none mergeable) and cast steps (4) than a copy holds inline
    shape = (2, 3, 2, 3, 2, 3)
    source_strides = tuple(4 * s for s in (1, 2, 6, 12, 36, 72))
    destination_strides = (3888, 1296, 432, 144, 48, 16)
    copy = Copy(0, 0, source_strides, 0, 0, destination_strides, shape, "float32", "float64",
                ("bfloat16", "float16", "float32"))
    run_both([copy], [random_bytes(5, 4 * 216)], [bytes(8 * 2 * 3888)])


def test_a_contiguous_tensor_is_copied_whole():
    data = random_bytes(4, 3 * 5 * 7 * 2)
    copy = Copy(0, 0, (70, 14, 2), 0, 0, (70, 14, 2), (3, 5, 7), "bfloat16", "bfloat16")
    (out,) = run_both([copy], [data], [bytes(len(data))], threads=2)
    assert bytes(out) == data


# --- casts -----------------------------------------------------------------------------


def every_value(dtype: str) -> bytes:
    """Every bit pattern of a 1- or 2-byte dtype; random patterns and edges of wider ones."""
    size = itemsize(dtype)
    if size <= 2:
        return np.arange(256**size, dtype=f"u{size}").tobytes()
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 256, 80_000 * size, dtype=np.uint8).view(f"u{size}")
    if dtype not in FLOATING:
        edges = [np.iinfo(NUMPY_DTYPES[dtype]).min, np.iinfo(NUMPY_DTYPES[dtype]).max, 0, 1]
        edges += [sign * ((1 << e) + (1 << max(e - k, 0)) + d)
                  for e in range(8 * size - 1) for k in (3, 8, 9, 11, 24, 25, 54)
                  for d in (-1, 0, 1) for sign in (1, -1)]
        info = np.iinfo(NUMPY_DTYPES[dtype])
        inside = np.array([v for v in edges if info.min <= v <= info.max], dtype=dtype)
        return np.concatenate([bits, inside.view(f"u{size}")]).tobytes()
    # Values at and next to every format's largest, smallest normal and smallest
    # subnormal value, and at the midpoints beside them: where rounding decides.
    edges = []
    for target in FLOATING:
        info = ml_dtypes.finfo(NUMPY_DTYPES[target])
        for value in (float(info.max), float(info.smallest_normal), float(info.smallest_subnormal)):
            edges += [value * scale for scale in (0.25, 0.5, 0.75, 1, 1.0625, 1.125, 1.25, 1.5)]
    edges += [np.inf, 0.0, 1.0, 1 + 2**-8, 1 + 2**-9, 1 + 2**-11, 1 + 2**-4]
    with np.errstate(over="ignore"):
        exact = np.array(edges, np.float64).astype(NUMPY_DTYPES[dtype]).view(f"u{size}")
    sign = np.array(1 << (8 * size - 1), dtype=f"u{size}")
    edges = np.concatenate([exact, exact + 1, exact - 1])
    return np.concatenate([bits, edges, edges | sign]).tobytes()


@pytest.mark.parametrize("source", DTYPES)
def test_every_cast_matches_astype(source):
    values = every_value(source)
    count = len(values) // itemsize(source)
    copies = [
        Copy(0, 0, (itemsize(source),), k, 0, (itemsize(target),), (count,), source, target)
        for k, target in enumerate(sorted(FLOATING))
    ]
    run_both(copies, [values], [bytes(count * itemsize(t)) for t in sorted(FLOATING)])


def test_every_bool_byte_casts_as_numpy_bool():
    # A bool byte other than 0 and 1 is true, as numpy's own casts take it (ml_dtypes'
    # bool -> bfloat16 / fp8 would give the byte's value): 1 in every format, from all 256
    # bytes; a bool copied as bool keeps its byte.
    data = bytes(range(256))
    targets = sorted(FLOATING)
    copies = [Copy(0, 0, (1,), k, 0, (itemsize(t),), (256,), "bool", t)
              for k, t in enumerate(targets)]
    copies.append(Copy(0, 0, (1,), len(targets), 0, (1,), (256,), "bool", "bool"))
    out = run_both(copies, [data], [bytes(256 * itemsize(t)) for t in targets] + [bytes(256)])
    truth = np.frombuffer(data, np.uint8) != 0
    for target, got in zip(targets, out):
        values = np.frombuffer(bytes(got), NUMPY_DTYPES[target]).astype(np.float64)
        assert values.tolist() == truth.astype(np.float64).tolist(), target
    assert bytes(out[-1]) == data


def astype_via_kernel(values: np.ndarray, target: str) -> np.ndarray:
    out = np.zeros(values.shape, NUMPY_DTYPES[target])
    copy = Copy(0, 0, (values.itemsize,), 0, 0, (out.itemsize,), values.shape,
                values.dtype.name, target)
    cpp_backend.execute_copies([copy], [values], [out])
    return out


def test_fp8_overflow_follows_ml_dtypes():
    # e4m3fn has no infinity: past 464 (halfway to the next step above 448) it is NaN;
    # e5m2 overflows to infinity from 61440 (halfway above 57344).
    values = np.array([448, 464, 465, 1e6, np.inf, -np.inf], np.float32)
    e4m3 = astype_via_kernel(values, "float8_e4m3fn").view(np.uint8)
    assert list(e4m3) == [0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0xFF]
    values = np.array([57344, 61439, 61440, 1e6, -np.inf], np.float64)
    e5m2 = astype_via_kernel(values, "float8_e5m2").view(np.uint8)
    assert list(e5m2) == [0x7B, 0x7B, 0x7C, 0x7C, 0xFC]


def test_bfloat16_rounds_to_nearest_even_and_quiets_nan():
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x7F800001, 0xFFC00001, 0x00000001],
                    np.uint32)
    out = astype_via_kernel(bits.view(np.float32), "bfloat16").view(np.uint16)
    assert [hex(b) for b in out] == ["0x3f80", "0x3f82", "0x3f81", "0x7fc0", "0xffc0", "0x0"]


def test_float64_rounds_once_to_bfloat16():
    # Just above a bfloat16 midpoint, by less than float32 can hold: rounding through
    # float32 would land on the midpoint and then on the even neighbour below.
    value = np.array([1 + 2**-8 + 2**-40], np.float64)
    assert astype_via_kernel(value, "bfloat16").view(np.uint16)[0] == 0x3F81


def test_int64_rounds_once_to_bfloat16():
    value = np.array([2**60 + 2**52 + 1], np.int64)  # via float64 it would tie to even
    assert astype_via_kernel(value, "bfloat16").view(np.uint16)[0] == 0x5D81


@settings(max_examples=150, deadline=None)
@given(calls(max_copies=3), st.data(), st.integers(1, 4))
def test_copies_repeating_a_shape_match_the_reference(call, data, threads):
    """Records that differ from one before only in their buffers and offsets are prepared
    from it (cpp/copy_kernel.cpp, `PreparedShapes`): each still copies its own bytes."""
    from dataclasses import replace

    copies, sources, destinations = call
    for _ in range(data.draw(st.integers(1, 8))):
        copy = data.draw(st.sampled_from(copies))
        lead_s, lead_d = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
        seed = data.draw(st.integers(0, 2**32 - 1))
        sources.append(random_bytes(seed, lead_s + len(sources[copy.source])))
        destinations.append(random_bytes(seed + 1, lead_d + len(destinations[copy.destination])))
        copies.append(replace(copy, source=len(sources) - 1,
                              source_offset=copy.source_offset + lead_s,
                              destination=len(destinations) - 1,
                              destination_offset=copy.destination_offset + lead_d))
    run_both(copies, sources, destinations, threads)


@pytest.mark.parametrize(("repeat", "message"), [
    (Copy(0, 4, (4,), 0, 0, (4,), (2,), "float32", "float32"),
     "copy 1: source region (offset 4, shape (2,), strides (4,)) does not fit in source 0 "
     "of 8 bytes"),
    (Copy(0, 0, (4,), 0, -4, (4,), (2,), "float32", "float32"),
     "copy 1: destination region (offset -4, shape (2,), strides (4,)) does not fit in "
     "destination 0 of 8 bytes"),
    (Copy(0, 0, (4,), 0, 2**62, (4,), (2,), "float32", "float32"),
     "copy 1: destination region (offset 4611686018427387904"),
    (Copy(0, 2**63 - 1, (4,), 0, 0, (4,), (2,), "float32", "float32"),
     "copy 1: source region (offset 9223372036854775807"),
    (Copy(0, -(2**63), (4,), 0, 0, (4,), (2,), "float32", "float32"),
     "copy 1: source region (offset -9223372036854775808"),
])
def test_a_repeated_shape_out_of_bounds_is_refused_naming_the_copy(repeat, message):
    good = Copy(0, 0, (4,), 0, 0, (4,), (2,), "float32", "float32")
    numpy_message, cpp_message = refusals([good, repeat], [bytes(8)], [bytes(8)])
    assert numpy_message == cpp_message
    assert message in cpp_message


# --- refusals --------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(calls(max_copies=3), st.data())
def test_regions_out_of_bounds_are_refused_naming_the_copy(call, data):
    copies, sources, destinations = call
    nonempty = [k for k, c in enumerate(copies) if 0 not in c.shape]
    if not nonempty:
        return
    index = data.draw(st.sampled_from(nonempty))
    copy = copies[index]
    side = data.draw(st.sampled_from(["source", "destination"]))
    buffers = sources if side == "source" else destinations
    number = getattr(copy, side)
    dtype = getattr(copy, f"{side}_dtype")
    strides, offset = getattr(copy, f"{side}_strides"), getattr(copy, f"{side}_offset")
    spans = [(n - 1) * s for n, s in zip(copy.shape, strides, strict=True)]
    low = offset + sum(s for s in spans if s < 0)
    high = offset + sum(s for s in spans if s > 0) + itemsize(dtype)
    how = data.draw(st.sampled_from(["short buffer", "before the start", "huge stride"]))
    if how == "short buffer":
        buffers[number] = buffers[number][: data.draw(st.integers(0, high - 1))]
    elif how == "before the start":
        copies[index] = _replace(copy, side, offset=offset - low - data.draw(st.integers(1, 9)))
    else:
        if not copy.shape:
            return
        axis = data.draw(st.integers(0, len(copy.shape) - 1))
        if copy.shape[axis] == 1:
            return
        big = list(strides)
        big[axis] = data.draw(st.sampled_from([2**62, -(2**62), len(buffers[number]) + 1]))
        copies[index] = _replace(copy, side, strides=tuple(big))
    numpy_message, cpp_message = refusals(copies, sources, destinations)
    assert numpy_message == cpp_message
    assert f"copy {index}: {side} region" in cpp_message


def _replace(copy: Copy, side: str, **fields) -> Copy:
    from dataclasses import replace

    return replace(copy, **{f"{side}_{name}": value for name, value in fields.items()})


def test_empty_regions_are_always_in_bounds():
    copy = Copy(0, 10**12, (4, -(10**15)), 0, -5, (8, 3), (3, 0), "float32", "float64")
    run_both([copy], [b""], [b"abc"])


@pytest.mark.parametrize(
    ("copy", "message"),
    [
        (Copy(1, 0, (4,), 0, 0, (4,), (2,), "float32", "float32"),
         "copy 1: source 1 does not exist (1 sources)"),
        (Copy(0, 0, (4,), -1, 0, (4,), (2,), "float32", "float32"),
         "copy 1: destination -1 does not exist (1 destinations)"),
        (Copy(0, 0, (4,), 0, 0, (4,), (2,), "float32", "int32"),
         "copy 1: cannot cast float32 to int32: only casts to floating types"),
        (Copy(0, 0, (2,), 0, 0, (4,), (2,), "int16", "int32"),
         "copy 1: cannot cast int16 to int32"),
        (Copy(0, 0, (1,), 0, 0, (1,), (2,), "uint8", "bool"),
         "copy 1: cannot cast uint8 to bool"),
        (Copy(0, 0, (4,), 0, 0, (4,), (2,), "float32", "float32", ("int32",)),
         "copy 1: cannot cast float32 to int32"),
        (Copy(0, 0, (4,), 0, 0, (4,), (-2,), "float32", "float32"),
         "copy 1: negative extent in shape (-2,)"),
        (Copy(0, 0, (0, 0), 0, 0, (0, 0), (2**40, 2**40), "float32", "float32"),
         "copy 1: shape (1099511627776, 1099511627776) has too many elements"),
        (Copy(0, 0, (4,), 0, 0, (4,), (2,), "float33", "float32"),
         "copy 1: unknown dtype 'float33'"),
        (Copy(0, 0, (4, 4), 0, 0, (4,), (2,), "float32", "float32"),
         "copy 1: shape (2,) and source strides (4, 4) differ in length"),
    ],
)
def test_bad_copies_are_refused_before_any_byte_moves(copy, message):
    good = Copy(0, 0, (4,), 0, 0, (4,), (2,), "float32", "float32")
    numpy_message, cpp_message = refusals([good, copy], [bytes(8)], [bytes(8)])
    assert numpy_message == cpp_message
    assert message in cpp_message


RECORD = (0, 0, 0, 0, 1, 1, 0, 1, 2, 4, 4, 0)  # 2 float32, contiguous, no scales


def test_the_kernel_runs_a_table():
    sources, destinations = [bytes(range(8))], [bytearray(8)]
    _core.execute_copies(np.array(RECORD, np.int64), sources, destinations)
    assert destinations[0] == sources[0]


@pytest.mark.parametrize(("table", "threads", "error", "message"), [
    ((*RECORD, *RECORD[:-1]), 1, _core.CopyError, "copy 1: the table ends inside"),
    ((0, 0, 0, 0, 15, 1, 0, 0), 1, _core.CopyError, "copy 0: unknown dtype code 15"),
    ((0, 0, 0, 0, 1, 1, 1, -1, 0), 1, _core.CopyError, "copy 0: unknown dtype code -1"),
    ((0, 0, 0, 0, 1, 1, 0, -1), 1, _core.CopyError, "copy 0: negative number of axes"),
    ((*RECORD[:-1], 2), 1, _core.CopyError, "copy 0: has_scale is 2, not 0 or 1"),
    (np.zeros(3, np.int32), 1, ValueError, "int64"),
    (RECORD, 0, ValueError, "threads"),
])
def test_the_kernel_refuses_bad_tables(table, threads, error, message):
    destinations = [bytearray(8)]
    with pytest.raises(error, match=message):
        _core.execute_copies(np.asarray(table, np.int64) if isinstance(table, tuple) else table,
                             [bytes(range(8))], destinations, threads=threads)
    assert destinations[0] == bytearray(8)


def _read_only() -> np.ndarray:
    array = np.zeros(2, np.float32)
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("execute", [numpy_backend.execute_copies, cpp_backend.execute_copies])
@pytest.mark.parametrize("destination", [bytes(8), np.zeros(4, np.float32)[::2], _read_only()],
                         ids=["bytes", "strided", "read-only"])
def test_destinations_must_be_writable_and_contiguous(execute, destination):
    copy = Copy(0, 0, (4,), 0, 0, (4,), (2,), "float32", "float32")
    with pytest.raises(ExecutionError, match="destination 0 is not a"):
        execute([copy], [bytes(8)], [destination])


def test_threads_must_be_at_least_one():
    copy = Copy(0, 0, (4,), 0, 0, (4,), (2,), "float32", "float32")
    with pytest.raises(UsageError):
        cpp_backend.execute_copies([copy], [bytes(8)], [bytearray(8)], threads=0)


def test_numbers_beyond_int64_are_refused():
    copy = Copy(0, 2**64, (4,), 0, 0, (4,), (2,), "float32", "float32")
    with pytest.raises(ExecutionError, match="copy 0: "):
        numpy_backend.execute_copies([copy], [bytes(8)], [bytearray(8)])
    with pytest.raises(ExecutionError, match="copy 0: a number does not fit in 64 bits"):
        cpp_backend.execute_copies([copy], [bytes(8)], [bytearray(8)])


# --- buffers ---------------------------------------------------------------------------


def test_every_kind_of_buffer(tmp_path):
    values = np.arange(6, dtype=np.float32)
    path = tmp_path / "data"
    path.write_bytes(values.tobytes())
    with path.open("r+b") as file, mmap.mmap(file.fileno(), 0) as mapped:
        sources = [values.tobytes(), bytearray(values.tobytes()), memoryview(values.tobytes()),
                   mapped, values.reshape(2, 3), values.astype(ml_dtypes.bfloat16)]
        copies = [Copy(k, 0, (4,), k, 0, (2,), (6,), "float32", "bfloat16") for k in range(5)]
        copies.append(Copy(5, 0, (2,), 5, 0, (4,), (6,), "bfloat16", "float32"))
        for execute in (numpy_backend.execute_copies, cpp_backend.execute_copies):
            outputs = [np.zeros(6, ml_dtypes.bfloat16), bytearray(12), memoryview(bytearray(12)),
                       np.zeros(6, ml_dtypes.bfloat16), np.zeros(6, ml_dtypes.bfloat16),
                       np.zeros((3, 2), np.float32)]
            execute(copies, sources, outputs)
            for k, output in enumerate(outputs[:5]):
                written = numpy_backend.byte_array(output, f"output {k}", writable=False)
                assert written.view(ml_dtypes.bfloat16).tolist() == values.tolist()
            assert outputs[5].ravel().tolist() == values.tolist()


def test_dtype_codes_match_the_kernel():
    assert cpp_backend.DTYPE_CODES == _core.DTYPE_CODES
    assert set(cpp_backend.DTYPE_CODES) == set(NUMPY_DTYPES)

