"""`aoa convert`: a checkpoint, through a mapping, into a checkpoint folder of another layout
and format.

prepare (compile, plan, decide the destination shards and the files that hold them; nothing
is written, so a dry run can print it) -> execute (the destination locks the output folder,
writes each file through staging buffers the kernel fills, then publishes them all with the
index). Memory stays near the staging buffers: source bytes are read through the source
files' mappings, and their pages dropped once read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from aoa.block_scales import Quantized, without_scales
from aoa.collector import collector_paused
from aoa.errors import PlanError, UsageError
from aoa.jobs.job import Job, ShardInfo, derived_outputs, plan_job
from aoa.layout import ShardDesc, check_tiling
from aoa.mapping import MappingText, as_mapping
from aoa.mesh_layout import MeshLayout
from aoa.passes.context import CompileContext
from aoa.plan import Plan
from aoa.storage.formats import Destination, Format, OutputFile, Source, format_named
from aoa.storage.stacked import Stacking, stack_shards


@dataclass
class Conversion:
    """What a conversion will write (or wrote): the job, the destination format and files.
    ``stored``: the destination shards as the format stores them, where their keys are
    stacked (`aoa.storage.stacked`; same order and bytes as the plan's); ``objects``: the
    items that are not tensors to write (None: the source's, where the format holds them)."""

    job: Job
    format: Format
    files: list[OutputFile]
    seconds: float = 0.0
    stored: list[ShardDesc] | None = None
    objects: dict[str, bytes] | None = None
    #: what the destination said about the write (a file system refusing direct I/O)
    write_notes: list[str] = field(default_factory=list)

    @property
    def plan(self) -> Plan:
        return self.job.plan

    @property
    def notes(self) -> list[str]:
        return self.job.notes

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def shards(self) -> list[ShardDesc]:
        """The destination shards as the files hold them."""
        return self.stored if self.stored is not None else self.plan.destinations

    def destination(self, output: str | Path, *, direct: bool = True) -> Destination:
        """The output checkpoint in ``output``, in the conversion's format; the source's
        objects are carried where the format holds the source format's objects."""
        destination = self.format.destination
        assert destination is not None
        source = self.job.source
        objects = self.objects
        if objects is None:
            objects = source.objects() if source.format in destination.objects_family else {}
        return destination(output, self.shards, self.files, source.extras(), objects,
                           direct=direct)

    def describe(self) -> str:
        assert self.format.destination is not None
        kind = ("sharded (one file per rank)" if self.format.destination.sharded
                else "Hugging Face")
        lines = [f"{len(self.files)} files, {self.format.name}, {kind}, {self.nbytes:,} bytes, "
                 f"{len(self.plan.destinations)} tensors"]
        for file in self.files:
            lines.append(f"  {file.filename}  {file.nbytes:,} bytes, {len(file.shards)} tensors")
            for index in file.shards:
                shard = self.shards[index]
                where = ("" if shard.local_shape == shard.global_shape else
                         f" at {list(shard.global_offset)} of {list(shard.global_shape)}")
                lines.append(f"    {shard.key}  {shard.dtype}  {list(shard.local_shape)}{where}")
        return "\n".join(lines)


def destination_shards(mapping: MappingText, source: ShardInfo, *,
                       layout: MeshLayout | None = None, destination: ShardInfo | None = None,
                       strict: bool = True
                       ) -> tuple[ShardInfo | None, list[list[int]] | None]:
    """The destination shards by key (None: derive whole outputs) and, when there are
    ranks, each rank's shards as positions in the key-by-key listing.

    A mesh layout splits what the program makes (compiled once without a destination for
    that; ``strict``: a rule that decides no tensor is an error); with a shard list, rank i
    holds the i-th listed shard of each key."""
    if layout is not None and destination is not None:
        raise UsageError("give a layout or a destination shard list, not both")
    if layout is not None:
        shards = layout.shards(derived_outputs(mapping, source, strict=strict), strict=strict)
        return shards.by_key, shards.ranks
    if destination is None:
        return None, None
    return destination, _ranks_of_listing(list(map(len, destination.values())))


def _ranks_of_listing(counts: list[int]) -> list[list[int]]:
    """Rank i's positions in a key-by-key listing of shards, ``counts[k]`` shards of key k:
    the i-th of each key that has one (numbered with numpy: 125k shards in milliseconds)."""
    sizes = np.array(counts, np.int64)
    if not sizes.any():
        return []
    starts = np.cumsum(sizes) - sizes
    within = np.arange(int(sizes.sum()), dtype=np.int64) - np.repeat(starts, sizes)
    order = np.argsort(within, kind="stable")  # by rank, then by position
    bounds = np.cumsum(np.bincount(within))[:-1]
    return [part.tolist() for part in np.split(order, bounds)]


def _check_whole(ctx: CompileContext) -> None:
    """A shard list's boxes tile each key (a replica counts once): one that leaves elements
    out, or lists boxes that overlap, would be written without complaint, then refused by
    aoa's own readers, which ask that of every checkpoint's chunks. An empty box (no
    element) may not start where a box with elements does: readers find a chunk by its key
    and offset (torch's DCP loader then fails on the sizes). Keys sharded alike are checked
    once."""
    destination = ctx.destination
    if destination is None:
        return
    checked: set[int] = set()
    for key, number in ctx.destination_shardings.items():
        if number in checked:
            continue
        checked.add(number)
        shards = destination[key]
        check_tiling(key, shards, "destination")
        holding = {shard.global_offset: shard for shard in shards
                   if math.prod(shard.local_shape)}
        for shard in shards:
            other = holding.get(shard.global_offset)
            if other is not None and not math.prod(shard.local_shape):
                raise PlanError(
                    f"the destination shards of '{key}' put an empty box of shape "
                    f"{list(shard.local_shape)} at {list(shard.global_offset)}, where the box "
                    f"of shape {list(other.local_shape)} starts",
                    hint="A checkpoint's chunks are found by key and offset (aoa's and "
                         "torch's readers): leave the empty box out, or start it where no "
                         "other box does.")


def prepare(mapping: MappingText | str | Sequence[str], source: Source, *,
            layout: MeshLayout | None = None, destination: ShardInfo | None = None,
            output_format: str | None = None, max_file_bytes: int | None = None,
            stacking: Sequence[Stacking] = (), objects: Mapping[str, bytes] | None = None,
            quantized: Mapping[str, Quantized] | None = None, strict: bool = True
            ) -> Conversion:
    """Compile and plan; decide the destination shards and the files that hold them.

    No layout and no destination: full, unsharded tensors (``safetensors``, Hugging Face
    files, by default). A layout (mesh and rules) or a shard-info mapping: one file per rank
    (``dcp-safetensors`` by default). ``max_file_bytes``: the format's limit per file
    (None: its default). ``stacking``: store the destination keys stacked by these rules;
    ``objects``: write these items that are not tensors (default: carry the source's where
    the format holds them). ``quantized``: source keys stored with block scales
    (`aoa.block_scales`), dequantized where the mapping casts them; the mapping does not see
    their scales. ``strict`` (default) refuses likely mistakes in the mapping and the
    layout; False keeps Paddle's meaning (`aoa.passes.context.CompileContext`)."""
    mapping = as_mapping(mapping)
    format = format_named(output_format, "output") if output_format is not None else None
    by_key, ranks = destination_shards(mapping, without_scales(source.shards, quantized),
                                       layout=layout, destination=destination, strict=strict)
    if format is None:
        format = format_named("dcp-safetensors" if ranks is not None else "safetensors",
                              "output")
    job = plan_job(mapping, source, by_key, quantized=quantized, strict=strict)
    if destination is not None:
        _check_whole(job.compilation.ctx)
    assert format.destination is not None
    stored = stack_shards(job.plan.destinations, stacking) if stacking else None
    files = format.destination.plan_files(stored or job.plan.destinations, ranks,
                                          max_file_bytes=max_file_bytes)
    return Conversion(job, format, files, stored=stored,
                      objects=None if objects is None else dict(objects))


def execute(conversion: Conversion, output: str | Path, *, threads: int | None = None,
            backend: str = "cpp", progress: Callable[[int], None] | None = None,
            direct: bool = True) -> list[Path]:
    """Write every file of the conversion into ``output`` and publish them with the index;
    ``direct``: write around the page cache where the file system allows. A failure (or an
    interrupt) leaves nothing."""
    with conversion.destination(output, direct=direct) as destination:
        destination.check()
        start = time.perf_counter()
        paths = write(conversion, destination, conversion.files, threads=threads,
                      backend=backend, progress=progress)
        paths += destination.commit()
    conversion.seconds = time.perf_counter() - start
    conversion.write_notes = destination.notes
    return paths


def write(conversion: Conversion, destination: Destination, files: Sequence[OutputFile], *,
          threads: int | None = None, backend: str = "cpp",
          progress: Callable[[int], None] | None = None) -> list[Path]:
    """Fill and finish ``files`` of the conversion (all, or a rank's share).

    The cyclic garbage collector waits meanwhile: the write makes a few short-lived objects
    per copy and no cycles, while each of its full collections walks the whole plan again
    (at 61x256, 189k copies: a third of the conversion's time, `bench/small_tensors.py`)."""
    with collector_paused():
        executor = conversion.job.executor(backend=backend, threads=threads,
                                           progress=progress, clear_untouched=True)
        try:
            return destination.write(executor.fill, files, expect=executor.expect)
        finally:
            executor.close()
