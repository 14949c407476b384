"""Python's cyclic garbage collector, paused around work that makes hundreds of thousands of
objects and no reference cycles (compiling, reading a checkpoint's headers): each of its
collections walks every object alive, so on a big model it would take more time than the
work itself."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block (left paused where it already was)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
