"""The aoa copy kernel (cpp/bindings.cpp): strided region copies with fused casts; and
records made in bulk (cpp/records.cpp)."""

from collections.abc import Iterable, Sequence
from typing import Any

#: dtype name (Paddle's) -> the code the copy table uses for it (enum aoa::Dtype)
DTYPE_CODES: dict[str, int]

class CopyError(ValueError):
    """A copy table the kernel refuses; the message names the copy. Nothing was written."""

class BusError(RuntimeError):
    """Memory behind a buffer vanished while the copies ran (a mapped file truncated):
    ``args`` are (message, role, index, offset): "source" or "destination" (None: in
    neither), the buffer's index and the byte offset in it. The copies stopped there."""

def execute_copies(table: Any, sources: Sequence[Any], destinations: Sequence[Any],
                   threads: int = 1, windows: Any = None, source_windows: Any = None) -> None:
    """Run every copy of ``table`` (a contiguous 1-d int64 buffer of records, see
    cpp/copy_kernel.hpp) from the ``sources`` buffers into the writable ``destinations``
    (or, with ``windows``, a contiguous (n, 3) int64 buffer of rows buffer, offset, bytes:
    those ranges of them, each checked to lie inside its buffer; ``source_windows`` the
    same for the sources), on up to ``threads`` threads, the GIL released. Raises
    CopyError naming the copy before any byte moves, BusError where a buffer's memory
    vanished under the copies."""

def new_records(cls: type[Any], fields: tuple[str, ...], columns: Sequence[Iterable[Any]]
                ) -> list[Any]:
    """Objects of the slotted class ``cls``, one per row of ``columns`` (iterables of one
    length, one per name in ``fields``), each field set through its slot: the class is not
    called, so nothing is checked (for rows checked in bulk)."""

def new_record_groups(cls: type[Any], fields: tuple[str, ...], heads: Sequence[Any],
                      rows: Sequence[Sequence[tuple[Any, ...]]]) -> list[list[Any]]:
    """``[[cls(heads[i], *row) for row in rows[i]] for each i]``, made as `new_records`
    makes them (the class not called): rows are tuples of the fields after the first."""
