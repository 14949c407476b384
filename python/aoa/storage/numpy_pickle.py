"""numpy arrays as pickles hold them, read in place and written with a hole for the kernel.

``pickle`` stores an array as ``numpy.core.multiarray._reconstruct(numpy.ndarray, (0,), b"b")``
and then a BUILD with ``(version, shape, dtype, is_fortran, raw bytes)``; the dtype is itself
``numpy.dtype(code, False, True)`` with a BUILD of ``(3, byte order, ...)``. Paddle's
``paddle.save`` writes every tensor this way (bfloat16 as ``uint16``, fp8 as ``int8``: the
element type comes from the checkpoint's metadata, only the size from the array).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aoa.errors import StorageError
from aoa.storage import pickler, unpickler

_RECONSTRUCT = ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct")
_DTYPE = "numpy.dtype"

ALLOWED: unpickler.Allowed = unpickler.records(*_RECONSTRUCT, "numpy.ndarray", _DTYPE)

#: The numpy type code aoa writes for each dtype, as Paddle's ``np.array(tensor)`` gives it.
ARRAY_CODES = {
    "float64": "f8", "float32": "f4", "float16": "f2", "bfloat16": "u2",
    "float8_e4m3fn": "i1", "float8_e5m2": "i1", "int64": "i8", "int32": "i4",
    "int16": "i2", "int8": "i1", "uint64": "u8", "uint32": "u4", "uint16": "u2",
    "uint8": "u1", "bool": "b1",
}
#: The codes read back: those written, and no other ("f16" is numpy's long double, "i0"
#: no type at all).
_READ_CODES = frozenset(ARRAY_CODES.values())


@dataclass(frozen=True)
class PickledArray:
    """An array of a pickle: its numpy dtype, shape, order and bytes (in place when the
    pickle held them as a bytes payload)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool
    offset: int | None  # in the file; None when the bytes were not a payload
    data: memoryview

    @property
    def nbytes(self) -> int:
        return len(self.data)


def is_array(value: Any) -> bool:
    return isinstance(value, unpickler.Record) and value.cls.qualname in _RECONSTRUCT


def read_array(value: Any, where: str | Path, what: str) -> PickledArray:
    """The array record ``value`` (from `ALLOWED`), every field checked."""
    if not is_array(value) or not isinstance(value.state, tuple) or len(value.state) != 5:
        raise StorageError(f"{where}: {what} is not a pickled numpy array")
    _, shape_value, dtype_record, fortran, raw = value.state
    shape = unpickler.int_tuple(shape_value, where, f"{what}'s shape")
    dtype = _dtype(dtype_record, where, what)
    if isinstance(raw, unpickler.Payload):
        offset, data = raw.offset, raw.data
    elif isinstance(raw, (bytes, str)):  # protocol 2 bytes: _codecs.encode; Python 2: str
        offset, data = None, memoryview(raw.encode("latin-1") if isinstance(raw, str) else raw)
    else:
        raise StorageError(f"{where}: {what} holds {type(raw).__name__}, not raw bytes "
                           "(an object array?)")
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise StorageError(f"{where}: {what} holds {len(data)} bytes, but {dtype.str} "
                           f"{list(shape)} needs {expected}")
    return PickledArray(dtype, shape, bool(fortran), offset, data)


def _dtype(record: Any, where: str | Path, what: str) -> np.dtype:
    if not (unpickler.is_record(record, _DTYPE) and record.args
            and isinstance(record.args[0], str)):
        raise StorageError(f"{where}: {what} has no numpy dtype")
    code = record.args[0]
    order = record.state[1] if isinstance(record.state, tuple) and len(record.state) > 1 \
        else "|"
    if code not in _READ_CODES:
        raise StorageError(f"{where}: {what} has numpy dtype '{code}', which aoa does not read")
    if order == ">":
        raise StorageError(f"{where}: {what} is big-endian, which aoa does not read")
    return np.dtype(code)


def array_value(dtype: str, shape: tuple[int, ...], hole: pickler.Hole) -> pickler.Build:
    """The pickle of a C-order array of ``dtype`` (aoa's name) whose bytes are ``hole``, as
    numpy 1.x (Paddle's) writes it."""
    code = ARRAY_CODES[dtype]
    order = "|" if code[1:] == "1" else "<"
    numpy_dtype = pickler.Build(pickler.Call(pickler.Global("numpy", "dtype"), (code, False, True)),
                                (3, order, None, None, None, -1, -1, 0))
    array = pickler.Call(pickler.Global("numpy.core.multiarray", "_reconstruct"),
                         (pickler.Global("numpy", "ndarray"), (0,), b"b"))
    return pickler.Build(array, (1, shape, numpy_dtype, False, hole))
