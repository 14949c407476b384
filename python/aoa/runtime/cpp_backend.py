"""The C++ backend: every copy packed into one int64 table (`aoa.runtime.kernel_table`), run
by one kernel call.

The kernel (cpp/copy_kernel.cpp) checks the whole table before any byte moves and runs
with the GIL released, on ``threads`` threads; this module only packs and chooses threads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import aoa._core as _core
from aoa.errors import ExecutionError, UsageError
from aoa.limits import usable_cpus
from aoa.runtime.copies import Copy
from aoa.runtime.executor import VanishedBuffer
from aoa.runtime.kernel_table import DTYPE_CODES, pack

__all__ = ["DTYPE_CODES", "execute_copies", "execute_table", "pack"]


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
    execute_table(pack(copies), sources, destinations, threads)


def execute_table(table: np.ndarray, sources: Sequence[object], destinations: Sequence[object],
                  threads: int | None = None, windows: np.ndarray | None = None,
                  source_windows: np.ndarray | None = None) -> None:
    """`execute_copies` of copies packed already (`aoa.runtime.kernel_table`); ``windows``,
    when given, an int64 array of (buffer, offset, bytes) rows: the destinations the table
    numbers are these ranges of ``destinations``, each checked to lie inside its buffer;
    ``source_windows`` the same for the sources."""
    if threads is None:
        threads = usable_cpus()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise UsageError(f"threads must be a whole number from 1, not {threads!r}")
    try:
        _core.execute_copies(table, list(sources), list(destinations), threads, windows,
                             source_windows)
    except ValueError as error:
        raise ExecutionError(str(error)) from None
    except _core.BusError as error:
        message, role, index, offset = error.args
        raise VanishedBuffer(message, role, index, offset) from None
