"""The C++ backend: every copy packed into one int64 table, run by one kernel call.

The kernel (cpp/copy_kernel.cpp) checks the whole table before any byte moves and runs
with the GIL released, on ``threads`` threads; this module only packs and chooses threads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import aoa._core as _core
from aoa.errors import ExecutionError, UsageError
from aoa.limits import usable_cpus
from aoa.runtime.copies import Copy, check_fields
from aoa.runtime.executor import VanishedBuffer

#: Paddle dtype name -> the kernel's code (enum aoa::Dtype in cpp/casts.hpp), as the
#: kernel itself says.
DTYPE_CODES: dict[str, int] = dict(_core.DTYPE_CODES)


def execute_copies(
    copies: Sequence[Copy],
    sources: Sequence[object],
    destinations: Sequence[object],
    threads: int | None = None,
) -> None:
    """Run ``copies`` from the ``sources`` buffers into the writable ``destinations``.

    ``threads`` defaults to the CPUs this process may use; the kernel uses fewer when
    there is too little work to share.
    """
    if threads is None:
        threads = usable_cpus()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise UsageError(f"threads must be a whole number from 1, not {threads!r}")
    table = pack(copies)
    try:
        _core.execute_copies(table, list(sources), list(destinations), threads)
    except ValueError as error:
        raise ExecutionError(str(error)) from None
    except _core.BusError as error:
        message, role, index, offset = error.args
        raise VanishedBuffer(message, role, index, offset) from None


def pack(copies: Sequence[Copy]) -> np.ndarray:
    """The kernel's table: one record per copy, the layout of cpp/copy_kernel.hpp."""
    fields: list[int] = []
    for index, copy in enumerate(copies):
        check_fields(index, copy)
        fields += (
            copy.source, copy.source_offset, copy.destination, copy.destination_offset,
            DTYPE_CODES[copy.source_dtype], DTYPE_CODES[copy.destination_dtype],
            len(copy.via), *(DTYPE_CODES[dtype] for dtype in copy.via),
            len(copy.shape), *copy.shape, *copy.source_strides, *copy.destination_strides,
        )
        scale = copy.scale
        if scale is None:
            fields.append(0)
        else:
            fields += (1, scale.source, DTYPE_CODES[scale.dtype], scale.offset, *scale.blocks,
                       *scale.phases, *scale.strides)
    try:
        return np.array(fields, dtype=np.int64)
    except OverflowError:
        index = next(i for i, copy in enumerate(copies) if not _fits_int64(copy))
        raise ExecutionError(f"copy {index}: a number does not fit in 64 bits") from None


def _fits_int64(copy: Copy) -> bool:
    numbers = (copy.source, copy.source_offset, copy.destination, copy.destination_offset,
               *copy.shape, *copy.source_strides, *copy.destination_strides)
    if copy.scale is not None:
        scale = copy.scale
        numbers += (scale.source, scale.offset, *scale.blocks, *scale.phases, *scale.strides)
    return all(-(2**63) <= n < 2**63 for n in numbers)
