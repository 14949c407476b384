"""The executor's unit of work: one strided region copy between two byte buffers.

A plan lowers to a list of these; the numpy reference backend and the C++ kernel both run
exactly this list, so they can be checked against each other byte for byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from aoa.dtypes import is_known
from aoa.errors import ExecutionError


@dataclass(frozen=True)
class Copy:
    """``destination[region] = cast(source[region])`` between two flat byte buffers.

    Both regions have ``shape`` (destination axis order). Strides are in bytes, one per
    destination axis; a permutation is folded into ``source_strides``. Values go from
    ``source_dtype`` through each dtype of ``via`` in turn (every step rounds, as numpy's
    ``astype`` does) to ``destination_dtype``.
    """

    source: int
    source_offset: int
    source_strides: tuple[int, ...]
    destination: int
    destination_offset: int
    destination_strides: tuple[int, ...]
    shape: tuple[int, ...]
    source_dtype: str
    destination_dtype: str
    via: tuple[str, ...] = ()


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def check_fields(index: int, copy: Copy) -> None:
    """Raise ExecutionError unless the dtypes are known and there is one stride per axis
    (what both backends check before they read a copy's numbers)."""
    for dtype in (copy.source_dtype, *copy.via, copy.destination_dtype):
        if not is_known(dtype):
            raise ExecutionError(f"copy {index}: unknown dtype {dtype!r}")
    for role, strides in (
        ("source", copy.source_strides), ("destination", copy.destination_strides)
    ):
        if len(strides) != len(copy.shape):
            raise ExecutionError(
                f"copy {index}: shape {tuple(copy.shape)} and {role} strides {tuple(strides)} "
                "differ in length"
            )
