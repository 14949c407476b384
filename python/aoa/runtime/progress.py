"""A byte-counting progress bar on stderr (tqdm), for the jobs that move many bytes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def progress_bar(total: int, description: str, *, show: bool = True,
                 terminal_only: bool = False) -> Iterator[Callable[[int], None] | None]:
    """Yields a function to call with each count of bytes done, or None when there is
    nothing to show: ``show`` is off, there are no bytes, or (``terminal_only``) stderr is
    not a terminal."""
    if not show or not total:
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=description,
               file=sys.stderr, leave=False, disable=None if terminal_only else False)
    try:
        yield bar.update
    finally:
        bar.close()
