"""The reference backend: every copy through numpy, one ``astype`` per rounding step.

Plain and slow on purpose: it is the oracle the C++ kernel is tested against byte for
byte, and it defines what a cast means (numpy's ``astype``, ml_dtypes' for bfloat16 and
fp8). It refuses what the kernel refuses, with the same messages, before any byte moves.

fp8 follows ml_dtypes exactly, with no saturation: a value beyond the range becomes NaN in
float8_e4m3fn, which has no infinity (from 464 up, halfway past its largest value 448),
and infinity in float8_e5m2 (from 61440, halfway past 57344). A float64 rounds once,
straight to bfloat16 or fp8, not through float32, as ml_dtypes does; an int64 rounds once
too. Casts to integers (from floats, or to another size) are refused.

A dequantizing copy (a `BlockScale`) is defined here: the stored values and their blocks'
scales, both as float32, multiplied in float32 (one rounding), then cast on as any copy.

A bool is numpy's: any nonzero byte is true, and casts to 1 in every format. (ml_dtypes'
bool -> bfloat16 and fp8 take the byte's value instead, 2 for a byte 2; so a bool is made
0 or 1 before any cast. A bool copied as bool keeps its bytes, as numpy's copy does.)
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from math import prod

import numpy as np
from numpy.lib.stride_tricks import as_strided

from aoa.dtypes import FLOATING, itemsize, numpy_dtype
from aoa.errors import ExecutionError
from aoa.runtime.copies import (
    DEQUANTIZED_SOURCES,
    SCALE_DTYPES,
    BlockScale,
    Copy,
    check_fields,
)

INTEGERS = frozenset({"int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8"})
_INT64_MAX = 2**63 - 1


def execute_copies(
    copies: Sequence[Copy], sources: Sequence[object], destinations: Sequence[object]
) -> None:
    """Run ``copies`` from the ``sources`` buffers into the writable ``destinations``.

    Each copy reads all its values before it writes: sources must not overlap destinations
    (nor destinations each other) for the kernel to agree.
    """
    source_bytes = [byte_array(b, f"source {i}", writable=False) for i, b in enumerate(sources)]
    destination_bytes = [
        byte_array(b, f"destination {i}", writable=True) for i, b in enumerate(destinations)
    ]
    for index, copy in enumerate(copies):
        check_copy(index, copy, [b.size for b in source_bytes], [b.size for b in destination_bytes])
    with np.errstate(all="ignore"):  # NaN and overflow are values here, not mistakes
        for copy in copies:
            if prod(copy.shape) == 0:
                continue
            values = _view(source_bytes[copy.source], copy.source_offset, copy.source_strides,
                           copy.shape, copy.source_dtype)
            if copy.source_dtype == "bool" and copy.destination_dtype != "bool":
                values = values.view(np.uint8) != 0
            if copy.scale is not None:
                values = values.astype(np.float32) * _scales(
                    source_bytes[copy.scale.source], copy.scale, copy.shape)
            for dtype in (*copy.via, copy.destination_dtype):
                values = values.astype(numpy_dtype(dtype))
            target = _view(destination_bytes[copy.destination], copy.destination_offset,
                           copy.destination_strides, copy.shape, copy.destination_dtype)
            target[...] = values


def byte_array(buffer: object, name: str, *, writable: bool) -> np.ndarray:
    """The bytes of a buffer as a flat uint8 array, without copying.

    numpy arrays go through ``view`` because numpy exports bfloat16 and fp8 arrays to no
    buffer consumer that asks for an item format, as ``memoryview`` does.
    """
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ExecutionError(f"{name} is not a contiguous buffer: the array is strided")
        if writable and not buffer.flags.writeable:
            raise ExecutionError(f"{name} is not a writable contiguous buffer: it is read-only")
        return buffer.reshape(-1).view(np.uint8)
    try:
        view = memoryview(buffer).cast("B")  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        raise ExecutionError(f"{name} is not a contiguous buffer: {error}") from None
    if writable and view.readonly:
        raise ExecutionError(f"{name} is not a writable contiguous buffer: it is read-only")
    return np.frombuffer(view, dtype=np.uint8)


def _scales(buffer: np.ndarray, scale: BlockScale, shape: tuple[int, ...]) -> np.ndarray:
    """Each element's scale as float32, an array of ``shape``: the scales' region, widened,
    with each block's scale repeated over the block's elements."""
    grid = _view(buffer, scale.offset, scale.strides, scale.extents(shape), scale.dtype)
    blocks = [(phase + np.arange(extent)) // block
              for phase, extent, block in zip(scale.phases, shape, scale.blocks)]
    return grid.astype(np.float32)[np.ix_(*blocks)]


def cast_refusal(source: str, destination: str) -> str | None:
    """Why one ``astype`` step from ``source`` to ``destination`` is refused, or None."""
    if source == destination or destination in FLOATING:
        return None
    if source in INTEGERS and destination in INTEGERS and itemsize(source) == itemsize(destination):
        return None  # numpy wraps same-size integers around: the bytes stay
    return (
        f"cannot cast {source} to {destination}: only casts to floating types, "
        "and between integers of one size, are supported"
    )


def check_copy(
    index: int, copy: Copy, source_sizes: Sequence[int], destination_sizes: Sequence[int]
) -> None:
    """Raise ExecutionError, naming the copy, unless ``copy`` stays inside its buffers."""

    def refuse(why: str) -> ExecutionError:
        return ExecutionError(f"copy {index}: {why}")

    check_fields(index, copy)
    if not 0 <= copy.source < len(source_sizes):
        raise refuse(f"source {copy.source} does not exist ({len(source_sizes)} sources)")
    if not 0 <= copy.destination < len(destination_sizes):
        raise refuse(
            f"destination {copy.destination} does not exist ({len(destination_sizes)} destinations)"
        )
    scale = copy.scale
    if scale is not None:
        _check_scale_fields(copy, scale, len(source_sizes), refuse)
    chain = ("float32" if scale else copy.source_dtype, *copy.via, copy.destination_dtype)
    for source, destination in pairwise(chain):
        why = cast_refusal(source, destination)
        if why:
            raise refuse(why)
    shape = tuple(copy.shape)
    if any(extent < 0 for extent in shape):
        raise refuse(f"negative extent in shape {shape}")
    if 0 in shape:
        return  # copies nothing, so always in bounds
    if (itemsize(copy.source_dtype) + itemsize(copy.destination_dtype)) * prod(shape) > _INT64_MAX:
        raise refuse(f"shape {shape} has too many elements")
    for role, number, offset, strides, dtype, size in (
        ("source", copy.source, copy.source_offset, copy.source_strides, copy.source_dtype,
         source_sizes[copy.source]),
        ("destination", copy.destination, copy.destination_offset, copy.destination_strides,
         copy.destination_dtype, destination_sizes[copy.destination]),
    ):
        if not _fits(offset, shape, strides, itemsize(dtype), size):
            raise refuse(
                f"{role} region (offset {offset}, shape {shape}, strides {tuple(strides)}) "
                f"does not fit in {role} {number} of {size} bytes"
            )
    if scale is not None:
        blocks = scale.extents(shape)
        size = source_sizes[scale.source]
        if not _fits(scale.offset, blocks, scale.strides, itemsize(scale.dtype), size):
            raise refuse(
                f"scale region (offset {scale.offset}, blocks {blocks}, strides "
                f"{tuple(scale.strides)}) does not fit in source {scale.source} of {size} bytes"
            )


def _fits(offset: int, shape: Sequence[int], strides: Sequence[int], item: int,
          size: int) -> bool:
    """Whether a region of ``shape`` (no zero extent) lies within ``size`` bytes."""
    spans = [(extent - 1) * stride for extent, stride in zip(shape, strides, strict=True)]
    low = offset + sum(span for span in spans if span < 0)
    high = offset + sum(span for span in spans if span > 0) + item
    return low >= 0 and high <= size


def _check_scale_fields(copy: Copy, scale: BlockScale, sources: int, refuse) -> None:
    """What a dequantizing copy reads must be a scale region of a known kind."""
    if not 0 <= scale.source < sources:
        raise refuse(f"scale source {scale.source} does not exist ({sources} sources)")
    if copy.source_dtype not in DEQUANTIZED_SOURCES:
        raise refuse(f"cannot dequantize {copy.source_dtype}: the source must be one of "
                     f"{', '.join(DEQUANTIZED_SOURCES)}")
    if scale.dtype not in SCALE_DTYPES:
        raise refuse(f"scales of {scale.dtype}: they must be one of {', '.join(SCALE_DTYPES)}")
    if any(block < 1 for block in scale.blocks) or any(
            not 0 <= phase < block for phase, block in zip(scale.phases, scale.blocks)):
        raise refuse(f"scale blocks {tuple(scale.blocks)} and phases {tuple(scale.phases)}: "
                     "every block has an element, every phase lies within its block")


def _view(
    buffer: np.ndarray, offset: int, strides: Sequence[int], shape: Sequence[int], dtype: str
) -> np.ndarray:
    """The region as an array of ``dtype`` (checked to lie inside ``buffer``).

    Strided as bytes, one more axis over each item's bytes, then viewed as ``dtype``:
    ``as_strided`` goes through ``__array_interface__``, which cannot carry ml_dtypes types.
    """
    dt = numpy_dtype(dtype)
    items = as_strided(
        buffer[offset:], shape=(*shape, dt.itemsize), strides=(*strides, 1)
    )
    return items.view(dt)[..., 0]
