"""Work for the second core: a pure function run in a forked child while this process goes
on with other work, its result pickled back through a pipe.

`aoa convert --destination` read the destination's shard-info JSON (0.1 s for the 125k
shards of a 61-layer, 256-expert MoE) and opened the source (0.25 s, two rank headers of
~70 ms each) one after the other, on one core: now a child reads the JSON
(`aoa.mapping.shard_info_read_aside`) and another the later half of a folder's headers
(`SafetensorsFile.open_all`) while this process goes on. A child is a copy of this process
made for one function of aoa's own (the result is trusted as the parent's own objects are;
nothing from a checkpoint is unpickled).

Anything amiss gives no result, and the caller does the work itself, in order: forking is
not there (not Linux) or not safe (other threads run: a fork copies only the one calling),
the function raised (its error is raised again, with its place, when the caller does the
work), the child died. So a result, when there is one, is what the caller would have made.

While a child works, this process need not wait idle: work it is to do afterwards anyway
can be handed to `meanwhile` (`aoa convert` makes the `--destination`'s shard records while
the header child reads, instead of after opening the source).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

#: Reading worth a child: from this many bytes of text (a child costs ~2 ms, and handing
#: back what it read a few more).
WORTH_A_CHILD_BYTES = 1 << 20


#: Work to do instead of waiting for a child (`meanwhile`), in the order given.
_meanwhile: list[Callable[[], object]] = []


@contextlib.contextmanager
def meanwhile(work: Callable[[], object]) -> Iterator[None]:
    """``work()`` done, for the block, by the first `Pending.result` asked for in it (before
    it waits for its child), or not at all. For work the caller does after the block anyway,
    whose result or error it keeps: where it is done changes no result and no error."""
    _meanwhile.append(work)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            _meanwhile.remove(work)


class Pending(Generic[T]):
    """A child at work on a function; `result` waits for it."""

    def __init__(self, pid: int, pipe: int) -> None:
        self._pid = pid
        self._pipe = pipe
        self._waited = False

    def result(self) -> T | None:
        """The function's result, or None where the child gave none (do the work here).
        Work given to `meanwhile` is done first, while the child works."""
        if self._waited:
            return None
        while _meanwhile:
            _meanwhile.pop(0)()
        with os.fdopen(self._pipe, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(self._pid, 0)
        self._waited = True
        if status != 0 or not data:
            return None
        result: T = pickle.loads(data)
        return result

    def abandon(self) -> None:
        """Stop the child if it is still there (its result not asked for) and reap it."""
        if self._waited:
            return
        self._waited = True
        os.close(self._pipe)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._pid, signal.SIGKILL)
        os.waitpid(self._pid, 0)


@contextlib.contextmanager
def forked(work: Callable[[], T] | None) -> Iterator[Pending[T] | None]:
    """``work()`` started in a forked child, for the block: its `Pending`, or None where no
    child could be made safely, or there is no ``work`` (then do the work in the block). A
    child whose result the block did not ask for is stopped when the block ends."""
    if work is None or not sys.platform.startswith("linux") or threading.active_count() != 1:
        yield None
        return
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: run, hand the result over, leave without Python's teardown
        code = 1
        try:
            os.close(read_end)
            data = pickle.dumps(work(), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    pending: Pending[T] = Pending(pid, read_end)
    try:
        yield pending
    finally:
        pending.abandon()
