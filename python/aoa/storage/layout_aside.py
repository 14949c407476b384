"""The first rank file's layout, made on the second core while this process compiles.

`aoa convert --destination` writes one file per rank, and the disk waits for the first
file's layout before its first byte (rank 0 of the 61-layer, 256-expert MoE's TP4: 31k
header entries, ~45 ms), while the second core idles through the compile. That layout
depends only on the destination shards as listed, which the child reading the
`--destination` JSON has (`aoa.mapping.shard_info_read_aside`): once it has read them, it
forks a grandchild that lays out rank 0's file as ``dcp-safetensors`` from them (the
default for a shard list) into a memory file, at a low priority, and hands its rows over
at once. The grandchild is made from that small early child, not from this process: a
fork of this process after the source is open made each page the compile then wrote a
fault (+10k faults, +25 ms), and one after the compile more.

The layout is taken only where the conversion's shards compare equal to that listing (the
planner keeps the listed objects: identity first, ~1 ms), its format is
``dcp-safetensors``, its first file the one laid out, and the grandchild is done by then;
otherwise, and on any fault, the file is laid out as before, so every file and error is
the same as without it.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import pickle
import select
from collections.abc import Sequence
from typing import TYPE_CHECKING

from aoa.layout import ShardDesc
from aoa.shard_info_json import ShardRows

if TYPE_CHECKING:
    from aoa.storage.formats import FileLayout, OutputFile

#: A listing worth laying out aside: from this many shards (~1.5 us a shard; a fork of
#: the small child ~1 ms, and handing the layout back ~0.15 us a shard).
WORTH_A_GRANDCHILD_SHARDS = 16384

#: The folder the grandchild's destination names: a ``dcp-safetensors`` layout reads only
#: the shards and files (not the folder, the source's extras or objects); a failure's
#: message would name the folder, and this process then lays the file out itself.
_NOWHERE = "/nonexistent/aoa-layout-aside"


class LayoutAside:
    """Where a grandchild puts rank 0's layout of a listing: a memory file, and a pipe that
    says the layout's size (nothing: none made) once it is there."""

    #: the aside of the listing `shard_info_read_aside` returned last, until a conversion
    #: of it takes it (`aoa.jobs.convert.prepare`)
    pending: LayoutAside | None = None

    def __init__(self) -> None:
        self._memory = os.memfd_create("aoa-layout-aside", os.MFD_CLOEXEC)
        self._done, self._said = os.pipe()
        #: the listing (by key) this process made of the rows the grandchild laid out
        self.listing: dict[str, list[ShardDesc]] | None = None

    @classmethod
    def begin(cls) -> LayoutAside | None:
        """An aside to hand to a child that reads a listing, or None where there is no
        memory file."""
        return cls() if hasattr(os, "memfd_create") else None

    def started(self) -> None:
        """In this process, once the child is forked: only the grandchild says done."""
        os.close(self._said)
        self._said = -1

    def offer(self, listing: dict[str, list[ShardDesc]]) -> None:
        """In this process: ``listing`` is what it made of the rows the grandchild lays
        out; the aside is `pending` for a conversion of it (another one is closed)."""
        if LayoutAside.pending is not None:
            LayoutAside.pending.close()
        self.listing = listing
        LayoutAside.pending = self

    def lay_out_aside(self, rows: ShardRows) -> None:
        """In the child, with the listing's rows: fork a grandchild laying out rank 0's
        file, and go on at once. The grandchild keeps no other descriptor (the child's
        pipe to this process ends when the child does, and the command's output when the
        command does); one this process did not wait for ends on its own, its work lost."""
        if sum(map(len, rows[1])) < WORTH_A_GRANDCHILD_SHARDS:
            return
        if os.fork() != 0:
            return
        code = 1
        try:
            keep = {self._memory, self._said}
            for name in os.listdir("/proc/self/fd"):
                if int(name) > 2 and int(name) not in keep:
                    with contextlib.suppress(OSError):
                        os.close(int(name))
            nowhere = os.open(os.devnull, os.O_RDWR)
            for standard in (0, 1, 2):  # a pipe reading the command's output ends with it
                os.dup2(nowhere, standard)
            os.close(nowhere)
            os.nice(19)  # the second core's spare time only
            data = memoryview(pickle.dumps(_rank_zero_layout(rows), pickle.HIGHEST_PROTOCOL))
            done = 0
            while done < len(data):
                done += os.write(self._memory, data[done:])
            os.write(self._said, len(data).to_bytes(8, "little"))
            code = 0
        finally:
            os._exit(code)

    def ready(self, seconds: float) -> bool:
        """Whether the grandchild has said it is done (waiting up to ``seconds``)."""
        return bool(select.select([self._done], [], [], seconds)[0])

    def take(self, shards: Sequence[ShardDesc], file: OutputFile) -> FileLayout | None:
        """The layout of ``file``, the first file of ``shards``, where those are the
        listing's and the grandchild has laid it out by now (it is not waited for); None
        otherwise. Closes the aside either way."""
        try:
            listing = self.listing
            if listing is None or not self.ready(0):
                return None
            if shards != list(itertools.chain.from_iterable(listing.values())):
                return None
            said = os.read(self._done, 8)
            if len(said) != 8:
                return None
            with mmap.mmap(self._memory, int.from_bytes(said, "little"),
                           access=mmap.ACCESS_READ) as data:
                laid_out, layout = pickle.loads(data)
            return layout if laid_out == file else None  # type: ignore[no-any-return]
        finally:
            self.close()

    def close(self) -> None:
        for fd in (self._memory, self._done, self._said):
            if fd >= 0:
                os.close(fd)
        self._memory = self._done = self._said = -1
        if LayoutAside.pending is self:
            LayoutAside.pending = None


def _rank_zero_layout(rows: ShardRows) -> tuple[OutputFile, FileLayout]:
    """Rank 0's file of the listing ``rows`` as ``dcp-safetensors`` (its `OutputFile` and
    `FileLayout`): the first shard of each key (`aoa.jobs.convert.ranks_of_listing`), made
    and laid out alone (a quarter of the listing at TP4), their positions in the listing
    put back into the file and its spans."""
    import numpy as np

    from aoa.storage.dcp_safetensors import DcpSafetensorsDestination
    from aoa.storage.formats import FileLayout, OutputFile, ShardSpans

    keys, key_rows = rows
    counts = np.fromiter(map(len, key_rows), np.int64, len(key_rows))
    held = np.flatnonzero(counts).tolist()
    positions = (np.cumsum(counts) - counts)[held]
    firsts = [key_rows[k][0] for k in held]
    shards = ShardDesc.many_unchecked(map(keys.__getitem__, held), *zip(*firsts))
    alone = DcpSafetensorsDestination.plan_files(
        shards, [range(len(shards)), *[()] * (int(counts.max(initial=1)) - 1)])[0]
    layout = DcpSafetensorsDestination(_NOWHERE, shards, [alone]).layout(alone)
    assert isinstance(layout.shards, ShardSpans)
    return (OutputFile(alone.filename, tuple(positions.tolist()), alone.nbytes),
            FileLayout(layout.size, layout.fixed,
                       ShardSpans(positions, *layout.shards.columns[1:])))
