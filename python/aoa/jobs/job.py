"""The one job under every entry point: open the source, compile, plan, execute into
destinations.

`convert` (into a checkpoint folder), `load` (into the caller's buffers) and `distributed`
(either, spread over ranks) differ in where the destination shards come from and where
their bytes go; the steps between are here, once.

Each job compiles once, except where the destination shards depend on what the program
makes, and so need a compile before them:

* a mesh layout derives the destination shards from the outputs' shapes and dtypes
  (`derived_outputs`, a compile without a destination); the plan then needs a compile
  with those shards, because the program's meaning depends on them: fused macros
  (``fused_qkv``, ``fused_ffn``) split by the destination's shard counts, and macros match
  names against the destination's keys;
* `aoa.load` checks the caller's buffers against what the mapping makes on its own (a
  compile without a destination: names, shapes and dtypes, with messages about buffers)
  before planning into them, for the same reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aoa.block_scales import Quantized, read_scales, without_scales
from aoa.layout import ShardDesc
from aoa.mapping import MappingText
from aoa.passes import PIPELINE, propagate_shapes, through
from aoa.pipeline import Compilation, analyze
from aoa.plan import Plan
from aoa.record import FusedRecord, source_record
from aoa.runtime.executor import PlanExecutor
from aoa.storage.formats import Source

if TYPE_CHECKING:
    import numpy as np

ShardInfo = Mapping[str, Sequence[ShardDesc]]


def compile_mapping(mapping: MappingText, source: ShardInfo,
                    destination: ShardInfo | None = None, *, plan: bool = True,
                    strict: bool = False, fused: FusedRecord | None = None) -> Compilation:
    """Run the passes over ``mapping`` against the source's shards (and the destination's,
    when they are known); ``plan=False`` stops before planning (to ask what it makes).
    ``strict``: refuse likely mistakes; ``fused``: what the source records as fused
    (`aoa.passes.context.CompileContext`)."""
    return analyze(mapping.statements, source, destination, reverse=mapping.reverse,
                   file=mapping.file, passes=PIPELINE if plan else through(propagate_shapes),
                   strict=strict, fused=fused)


def derived_outputs(mapping: MappingText, source: ShardInfo, *, strict: bool = False
                    ) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """Key -> (global shape, dtype) of what ``mapping`` makes with no destination given,
    optimizer states included: what a mesh layout is applied to."""
    return compile_mapping(mapping, source, plan=False, strict=strict).derived_outputs()


@dataclass
class Job:
    """A mapping compiled and planned against an open source."""

    source: Source
    compilation: Compilation
    plan: Plan
    compile_seconds: float

    @property
    def notes(self) -> list[str]:
        return [note.render() for note in self.compilation.ctx.notes]

    def source_buffer(self, read: dict[int, ShardDesc] | None = None
                      ) -> Callable[[int], object]:
        """The buffer of the plan's source shard ``i``, from the source; ``read`` collects
        the shards asked for (by plan index)."""
        plan, source = self.plan, self.source

        def source_buffer(index: int) -> object:
            shard = plan.sources[index]
            if read is not None:
                read[index] = shard
            return source.buffer(shard)

        return source_buffer

    def source_buffers(self, read: dict[int, ShardDesc] | None = None
                       ) -> Callable[[list[int]], list[object]]:
        """`source_buffer` of many plan indices at once (what an executor's fill asks)."""
        sources = self.plan.sources
        buffers = self.source.plan_buffers(sources)

        def source_buffers(indices: list[int]) -> list[object]:
            if read is not None:
                read.update(zip(indices, map(sources.__getitem__, indices)))
            return list(buffers(indices))

        return source_buffers

    def source_windows(self, read: dict[int, ShardDesc] | None = None
                       ) -> Callable[[np.ndarray], tuple[list[memoryview], np.ndarray]] | None:
        """The source's `plan_windows` of the plan's source shards (None where the format
        gives a buffer per shard); ``read`` collects the shards asked for."""
        sources = self.plan.sources
        windows = self.source.plan_windows(sources)
        if windows is None or read is None:
            return windows
        answer = windows

        def recorded(indices: np.ndarray) -> tuple[list[memoryview], np.ndarray]:
            listed = indices.tolist()
            read.update(zip(listed, map(sources.__getitem__, listed)))
            return answer(indices)

        return recorded

    def executor(self, *, backend: str = "cpp", threads: int | None = None,
                 progress: Callable[[int], None] | None = None,
                 read: dict[int, ShardDesc] | None = None,
                 release_pages: bool = True, clear_untouched: bool = False) -> PlanExecutor:
        """An executor reading the plan's source shards from the source's buffers, and
        dropping their pages from memory after each fill (``release_pages``);
        ``clear_untouched``: see `PlanExecutor`."""
        plan, source = self.plan, self.source

        def source_file(index: int) -> object:
            return source.file_of(plan.sources[index])

        release = source.plan_release(plan.sources) if release_pages else None
        return PlanExecutor(plan, self.source_buffer(read), backend=backend, threads=threads,
                            source_buffers=self.source_buffers(read),
                            source_windows=self.source_windows(read),
                            source_extents=source.plan_extents(plan.sources),
                            progress=progress, release=release,
                            clear_untouched=clear_untouched, source_file=source_file)


def plan_job(mapping: MappingText, source: Source, destination: ShardInfo | None = None,
             *, quantized: Mapping[str, Quantized] | None = None, strict: bool = True) -> Job:
    """Compile ``mapping`` against ``source`` and ``destination`` (None: derive the outputs,
    whole) and plan every destination shard; ``quantized``: source keys stored with block
    scales, dequantized where they are read into another dtype (the mapping does not see
    their scales: the dequantization reads them). ``strict`` (the default of every job)
    refuses likely mistakes, the record beside the source saying what is stored fused."""
    start = time.perf_counter()
    compilation = compile_mapping(mapping, without_scales(source.shards, quantized),
                                  destination, strict=strict, fused=source_record(source.path))
    plan = compilation.plan()
    if quantized:
        plan = read_scales(plan, source.shards, quantized)
    return Job(source, compilation, plan, time.perf_counter() - start)
