"""Dequantizing copies (fp8 weights with a scale per block): the C++ kernel against the numpy
reference byte for byte, and the reference against the definition written out with
``np.repeat`` (DeepSeek-V3's ``weight_dequant``: ``float32(x) * s``, then the destination
dtype), over partial last blocks, boxes that start inside a block (a tensor-parallel split),
transposes and every scale dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aoa.dtypes import itemsize, numpy_dtype
from aoa.errors import ExecutionError
from aoa.runtime import cpp_backend, numpy_backend
from aoa.runtime.copies import BlockScale, Copy, c_strides

SOURCES = ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32")
SCALES = ("float32", "bfloat16", "float16")


def weight_copy(shape, block, start, box, order, destination, *, via=(),
                source="float8_e4m3fn", scale="float32"):
    """The copy of ``weight[start : start + box]``, axes in ``order``, into a C-contiguous
    destination: the weight is buffer 0 (C order), its scales buffer 1 (C order, one per
    block, the last blocks partial)."""
    weight_strides = c_strides(shape, itemsize(source))
    grid = tuple(-(-n // b) for n, b in zip(shape, block))
    scale_strides = c_strides(grid, itemsize(scale))
    out_shape = tuple(box[a] for a in order)
    return Copy(
        0, sum(s * t for s, t in zip(start, weight_strides)),
        tuple(weight_strides[a] for a in order), 0, 0,
        c_strides(out_shape, itemsize(destination)), out_shape, source, destination, via,
        BlockScale(1, sum(s // b * t for s, b, t in zip(start, block, scale_strides)),
                   tuple(scale_strides[a] for a in order), tuple(block[a] for a in order),
                   tuple(start[a] % block[a] for a in order), scale))


def buffers(shape, block, source, scale, seed):
    """Random bytes as the weight (NaN, infinity, subnormals included) and random scales."""
    rng = np.random.default_rng(seed)
    grid = tuple(-(-n // b) for n, b in zip(shape, block))
    weight = rng.integers(0, 256, int(np.prod(shape)) * itemsize(source), dtype=np.uint8)
    scales = (rng.standard_normal(grid) * 4).astype(np.float32).astype(numpy_dtype(scale))
    return weight, scales


def by_definition(weight, scales, shape, block, start, box, order, destination, via=(),
                  source="float8_e4m3fn"):
    """Every element times its block's scale, in float32, written with np.repeat."""
    values = weight.view(numpy_dtype(source)).reshape(shape).astype(np.float32)
    spread = scales.astype(np.float32)
    for axis, size in enumerate(block):
        spread = np.repeat(spread, size, axis=axis)
    spread = spread[tuple(slice(0, n) for n in shape)]
    with np.errstate(all="ignore"):
        product = values * spread
        region = product[tuple(slice(s, s + n) for s, n in zip(start, box))].transpose(order)
        for dtype in (*via, destination):
            region = region.astype(numpy_dtype(dtype))
    return np.ascontiguousarray(region).tobytes()


def run_both(copies, sources, size, threads=1) -> bytes:
    """Both backends into the same random bytes; asserts they agree; returns the bytes."""
    start = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    expected, actual = bytearray(start), bytearray(start)
    numpy_backend.execute_copies(copies, sources, [expected])
    cpp_backend.execute_copies(copies, sources, [actual], threads=threads)
    assert actual == expected
    return bytes(actual)


def nbytes(copy: Copy) -> int:
    return int(np.prod(copy.shape)) * itemsize(copy.destination_dtype)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["as stored", "transposed"])
@pytest.mark.parametrize(("start", "box"), [
    ((0, 0), (300, 200)),      # whole, both last blocks partial
    ((128, 0), (172, 200)),    # the rows of a second rank at a block boundary
    ((0, 100), (300, 100)),    # columns from inside a block: phase 100, a partial last
    ((37, 5), (200, 190)),     # inside blocks on both axes
])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_deepseek_block_weight_dequantizes_as_defined(order, start, box, threads):
    shape, block = (300, 200), (128, 128)
    weight, scales = buffers(shape, block, "float8_e4m3fn", "float32", seed=1)
    copy = weight_copy(shape, block, start, box, order, "bfloat16")
    got = run_both([copy], [weight, scales], nbytes(copy), threads)
    assert got == by_definition(weight, scales, shape, block, start, box, order, "bfloat16")


@st.composite
def dequantizations(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim)))
    block = tuple(draw(st.integers(1, 9)) for _ in shape)
    start = tuple(draw(st.integers(0, n - 1)) for n in shape)
    box = tuple(draw(st.integers(1, n - s)) for n, s in zip(shape, start))
    order = tuple(draw(st.permutations(range(ndim))))
    source = draw(st.sampled_from(SOURCES))
    scale = draw(st.sampled_from(SCALES))
    destination = draw(st.sampled_from(["bfloat16", "float16", "float32", "float64"]))
    via = tuple(draw(st.lists(st.sampled_from(["float16", "bfloat16", "float32"]), max_size=1)))
    return shape, block, start, box, order, source, scale, destination, via


@settings(max_examples=250, deadline=None)
@given(dequantizations(), st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_any_block_box_and_order_dequantizes_as_defined(case, seed, threads):
    shape, block, start, box, order, source, scale, destination, via = case
    weight, scales = buffers(shape, block, source, scale, seed)
    copy = weight_copy(shape, block, start, box, order, destination, via=via, source=source,
                       scale=scale)
    got = run_both([copy], [weight, scales], nbytes(copy), threads)
    assert got == by_definition(weight, scales, shape, block, start, box, order, destination,
                                via, source)


def test_every_fp8_value_times_every_scale_sign():
    """All 256 fp8 bytes (NaN included), with scales of both signs, zero and infinity."""
    weight = np.arange(256, dtype=np.uint8).reshape(16, 16)
    scales = np.array([[2.0, -0.5], [0.0, np.inf]], np.float32)
    copy = weight_copy((16, 16), (8, 8), (0, 0), (16, 16), (0, 1), "bfloat16")
    got = run_both([copy], [weight, scales], nbytes(copy))
    assert got == by_definition(weight, scales, (16, 16), (8, 8), (0, 0), (16, 16), (0, 1),
                                "bfloat16")


def test_large_transposed_copies_across_threads():
    shape, block = (1000, 700), (128, 128)
    weight, scales = buffers(shape, block, "float8_e4m3fn", "float32", seed=5)
    copies = [weight_copy(shape, block, (0, 0), shape, (1, 0), "bfloat16")]
    got = run_both(copies, [weight, scales], nbytes(copies[0]), threads=4)
    assert got == by_definition(weight, scales, shape, block, (0, 0), shape, (1, 0),
                                "bfloat16")


def test_a_plain_copy_beside_a_dequantizing_one():
    """Scales belong to their copy only: the next copy of the same weight moves bytes."""
    shape, block = (8, 8), (4, 4)
    weight, scales = buffers(shape, block, "float8_e4m3fn", "float32", seed=2)
    scaled = weight_copy(shape, block, (0, 0), shape, (0, 1), "float32")
    plain = Copy(0, 0, (8, 1), 0, 256, (8, 1), (8, 8), "float8_e4m3fn", "float8_e4m3fn")
    got = run_both([scaled, plain], [weight, scales], 256 + 64)
    assert got[256:] == weight.tobytes()


def _refusals(copy: Copy, sources) -> list[str]:
    messages = []
    for execute in (numpy_backend.execute_copies, cpp_backend.execute_copies):
        written = bytearray(64)
        with pytest.raises(ExecutionError) as error:
            execute([copy], sources, [written])
        assert written == bytearray(64)
        messages.append(error.value.message)
    return messages


def _with_scale(copy: Copy, **fields) -> Copy:
    import dataclasses

    assert copy.scale is not None
    return dataclasses.replace(copy, scale=dataclasses.replace(copy.scale, **fields))


GOOD = weight_copy((4, 4), (2, 2), (0, 0), (4, 4), (0, 1), "bfloat16")


@pytest.mark.parametrize(("copy", "message"), [
    (_with_scale(GOOD, source=2), "copy 0: scale source 2 does not exist (2 sources)"),
    (_with_scale(GOOD, source=-1), "copy 0: scale source -1 does not exist (2 sources)"),
    (_with_scale(GOOD, dtype="float64"),
     "copy 0: scales of float64: they must be one of float32, bfloat16, float16"),
    (_with_scale(GOOD, blocks=(0, 2)),
     "copy 0: scale blocks (0, 2) and phases (0, 0): every block has an element, every phase "
     "lies within its block"),
    (_with_scale(GOOD, phases=(2, 0)),
     "copy 0: scale blocks (2, 2) and phases (2, 0): every block has an element, every phase "
     "lies within its block"),
    (_with_scale(GOOD, offset=12),
     "copy 0: scale region (offset 12, blocks (2, 2), strides (8, 4)) does not fit in "
     "source 1 of 16 bytes"),
    (_with_scale(GOOD, phases=(1, 1)),
     "copy 0: scale region (offset 0, blocks (3, 3), strides (8, 4)) does not fit in "
     "source 1 of 16 bytes"),
    (weight_copy((4, 4), (2, 2), (0, 0), (4, 4), (0, 1), "int8"),
     "copy 0: cannot cast float32 to int8: only casts to floating types, and between "
     "integers of one size, are supported"),
])
def test_bad_scales_are_refused_alike_before_any_byte_moves(copy, message):
    sources = [np.zeros(16, np.uint8), np.ones((2, 2), np.float32)]
    assert _refusals(copy, sources) == [message, message]


def test_a_source_that_float32_cannot_hold_is_not_dequantized():
    copy = weight_copy((2, 2), (2, 2), (0, 0), (2, 2), (0, 1), "float32", source="float64")
    sources = [np.zeros(4, np.float64), np.ones((1, 1), np.float32)]
    message = ("copy 0: cannot dequantize float64: the source must be one of float8_e4m3fn, "
               "float8_e5m2, bfloat16, float16, float32")
    assert _refusals(copy, sources) == [message, message]


def test_the_reference_is_deepseeks_weight_dequant():
    """DeepSeek-V3's fp8_cast_bf16 (in torch): x.to(float32) * s per block, to bfloat16.
    (Not for NaN, which checkpoints do not hold: torch keeps a NaN's payload bits where aoa
    gives ml_dtypes' quiet NaN, as every aoa cast does.)"""
    torch = pytest.importorskip("torch")
    shape, block = (260, 130), (128, 128)
    weight, scales = buffers(shape, block, "float8_e4m3fn", "float32", seed=3)
    weight[(weight & 0x7F) == 0x7F] = 0  # no NaN
    x = torch.from_numpy(weight.reshape(shape).copy()).view(torch.float8_e4m3fn)
    s = torch.from_numpy(scales).repeat_interleave(128, 0).repeat_interleave(128, 1)
    want = (x.to(torch.float32) * s[:260, :130]).to(torch.bfloat16)
    copy = weight_copy(shape, block, (0, 0), shape, (0, 1), "bfloat16")
    got = np.frombuffer(run_both([copy], [weight, scales], nbytes(copy)), ml_dtypes.bfloat16)
    assert got.view(np.uint16).tobytes() == want.view(torch.int16).numpy().tobytes()
