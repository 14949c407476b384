"""Work across ranks: loads where each rank fills its own shards, conversions where each
rank writes its share of the files.

Compilation is deterministic, so every rank compiles the same plan from the same inputs;
the only things ranks tell each other are their shard descriptions (for `aoa.load`) and
whether they succeeded (so that an error on one rank is raised on all, and none waits
forever for another). Under torch.distributed that is `all_gather_object` on any backend;
torch is imported only when it is already in use (or torchrun's environment says so).

Without torch.distributed, `aoa convert --rank R --world-size N` coordinates through the
output folder (`aoa.storage.folder`): the ranks of one conversion share its lock, each
leaves a marker in the staging folder when its files are staged, and rank 0 publishes every
file and the index once every marker is there. Ranks need not run at the same time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aoa.errors import AoaError, UsageError
from aoa.layout import ShardDesc

if TYPE_CHECKING:  # aoa.jobs.convert is imported when a conversion runs, not to ask world()
    from aoa.jobs.convert import Conversion
    from aoa.storage.formats import OutputFile


# -- torch.distributed ---------------------------------------------------------------------


def world(group: object = None) -> tuple[int, int] | None:
    """(rank, world size) of an initialized torch.distributed, else None (torch is never
    imported here: a process group cannot exist unless torch already is)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(group), dist.get_world_size(group)


def threads_per_rank() -> int | None:
    """The CPUs of this process shared among the ranks on this machine (torchrun says how
    many there are in LOCAL_WORLD_SIZE), so that ranks do not fight over cores; None when
    this is the only one (the kernel then takes every CPU)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local <= 1:
        return None
    from aoa.limits import usable_cpus

    return max(1, usable_cpus() // local)


def _all_gather(value: object, group: object = None) -> list:
    dist = sys.modules["torch"].distributed
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def agree(error: BaseException | None, what: str, group: object = None) -> None:
    """A collective: raise on every rank if any rank failed; ``what`` says at what."""
    failures = _all_gather(None if error is None else _describe(error), group)
    if error is not None:
        raise error
    for rank, failure in enumerate(failures):
        if failure is not None:
            raise AoaError(f"rank {rank} failed {what}: {failure}")


def _describe(error: BaseException) -> str:
    return error.message if isinstance(error, AoaError) else f"{type(error).__name__}: {error}"


def gather_shards(local: Sequence[ShardDesc], error: AoaError | None, group: object = None
                  ) -> list[list[ShardDesc]]:
    """Every rank's shard descriptions, rank 0's first; raises on every rank if any rank
    could not describe its buffers (``error``)."""
    sent = ([s.to_json() for s in local], None if error is None else _describe(error))
    gathered = _all_gather(sent, group)
    if error is not None:
        raise error
    for rank, (_, failure) in enumerate(gathered):
        if failure is not None:
            raise UsageError(f"rank {rank} cannot load: {failure}")
    return [[ShardDesc.from_json(s) for s in shards] for shards, _ in gathered]


# -- a conversion split between ranks ------------------------------------------------------


def split_files(files: Sequence[OutputFile], world_size: int) -> list[list[OutputFile]]:
    """Each rank's files: largest first to the rank with the fewest bytes so far (the lower
    rank on a tie), each rank's in the conversion's order. The same on every rank."""
    loads = [0] * world_size
    owner: dict[int, int] = {}
    for position in sorted(range(len(files)), key=lambda i: (-files[i].nbytes, i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owner[position] = rank
        loads[rank] += files[position].nbytes
    return [[f for i, f in enumerate(files) if owner[i] == rank] for rank in range(world_size)]


@dataclass
class RankShare:
    """This process's part of a conversion: rank ``rank`` of ``world_size``. ``collective``:
    ranks agree through torch.distributed; else through marker files in the output."""

    rank: int
    world_size: int
    collective: bool
    group: object = None
    #: set when this process started the process group (and so ends it)
    owns_group: bool = False

    def files(self, conversion: Conversion) -> list[OutputFile]:
        return split_files(conversion.files, self.world_size)[self.rank]

    def execute(self, conversion: Conversion, output: str | os.PathLike[str], *,
                threads: int | None = None, progress: Callable[[int], None] | None = None,
                poll_seconds: float = 0.2, timeout: float | None = None) -> None:
        """Write this rank's files; rank 0 then publishes them all with the index, once every
        rank is done. A failure on any rank removes this rank's files.

        ``timeout`` bounds rank 0's wait for the other ranks' markers (None: no bound)."""
        from aoa.jobs.convert import write
        from aoa.storage.folder import Sharing

        mine = self.files(conversion)
        if threads is None and self.collective:
            threads = threads_per_rank()
        sharing = Sharing(_fingerprint(conversion), self.rank, self.world_size)
        with conversion.destination(Path(output)) as destination:
            error: BaseException | None = None
            if self.collective:
                try:
                    destination.check(sharing)  # before anyone writes: all see the same folder
                except AoaError as failure:
                    error = failure
                agree(error, "to check the output folder", self.group)
            else:
                destination.check(sharing)
            start = time.perf_counter()
            try:
                write(conversion, destination, mine, threads=threads, progress=progress)
            except Exception as failure:
                if not self.collective:
                    raise
                error = failure
            conversion.seconds = time.perf_counter() - start
            if self.collective:
                agree(error, "to write its files", self.group)  # the barrier before publishing
            elif self.rank != 0:
                destination.output.mark_done()
                return
            else:
                destination.output.wait_for_ranks(poll_seconds, timeout)
            if self.rank == 0:
                destination.commit()
            conversion.write_notes = destination.notes

    def close(self) -> None:
        if self.owns_group:
            sys.modules["torch"].distributed.destroy_process_group()
            self.owns_group = False


def rank_share(rank: int | None = None, world_size: int | None = None) -> RankShare | None:
    """The share of this process: from ``--rank/--world-size`` when given (ranks coordinate
    through the output folder), else from torchrun's environment (torch.distributed, a gloo
    group started here if none is), else None: one process does everything."""
    if (rank is None) != (world_size is None):
        raise UsageError("give --rank and --world-size together")
    if rank is not None and world_size is not None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise UsageError(f"--rank {rank} is not a rank of --world-size {world_size} "
                             "(ranks count from 0)")
        return RankShare(rank, world_size, collective=False) if world_size > 1 else None
    found = world()
    if found is not None:
        return RankShare(*found, collective=True) if found[1] > 1 else None
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size <= 1 or "MASTER_ADDR" not in os.environ:
        return None
    try:
        import torch.distributed as dist
    except ImportError:
        raise UsageError("WORLD_SIZE says this is one of several ranks, but torch is not "
                         "installed to coordinate them",
                         hint="Install torch, or give --rank and --world-size.") from None
    dist.init_process_group("gloo")
    return RankShare(dist.get_rank(), dist.get_world_size(), collective=True, owns_group=True)


def _fingerprint(conversion: Conversion) -> str:
    """Names this conversion: the plan, the files, and the source files as they are now.
    Files staged by an earlier run of the very same conversion have the same bytes, so its
    ranks may share the folder and rank 0 may trust their markers."""
    import hashlib  # here: loading OpenSSL costs every `aoa convert` 3-15 ms otherwise

    digest = hashlib.sha256(conversion.plan.dumps().encode())
    digest.update(json.dumps([[f.filename, f.shards] for f in conversion.files]).encode())
    for path in conversion.job.source.files():
        stat = path.stat()
        digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()
