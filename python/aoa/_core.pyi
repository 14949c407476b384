"""The aoa copy kernel (cpp/bindings.cpp): strided region copies with fused casts."""

from collections.abc import Sequence
from typing import Any

#: dtype name (Paddle's) -> the code the copy table uses for it (enum aoa::Dtype)
DTYPE_CODES: dict[str, int]

class CopyError(ValueError):
    """A copy table the kernel refuses; the message names the copy. Nothing was written."""

def execute_copies(table: Any, sources: Sequence[Any], destinations: Sequence[Any],
                   threads: int = 1) -> None:
    """Run every copy of ``table`` (a contiguous 1-d int64 buffer of records, see
    cpp/copy_kernel.hpp) from the ``sources`` buffers into the writable ``destinations``,
    on up to ``threads`` threads, the GIL released. Raises CopyError naming the copy before
    any byte moves."""
