"""The main job: convert a checkpoint folder through an AOA mapping into another layout.

compile -> validate -> write each destination file in place (the kernel fills its mapped
pages) -> index. Memory stays near one destination file: files are written one after
another, and source bytes are read through the source files' mappings.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aoa.destination_layout import MeshLayout
from aoa.errors import StorageError, UsageError
from aoa.layout import BETA_POW_SUFFIXES, OPTIMIZER_SUFFIXES, ShardDesc
from aoa.passes import propagate_shapes, through
from aoa.pipeline import analyze
from aoa.plan import Plan
from aoa.runtime.executor import PlanExecutor
from aoa.storage.checkpoint import (
    HfFile,
    RankFile,
    ShardSpec,
    SourceCheckpoint,
    plan_hf_files,
    plan_rank_files,
    write_hf_files,
    write_hf_index,
    write_sharded_checkpoint,
)
from aoa.storage.safetensors import TensorSpec
from aoa.symbolic import dtype_after

DEFAULT_MAX_FILE_BYTES = 5 * 10**9


@dataclass
class OutputFile:
    """A destination file: its name and the plan's destination shards it holds, in order."""

    filename: str
    shards: list[int]
    nbytes: int


@dataclass
class Conversion:
    """What a conversion will write (or wrote): the plan and the files."""

    plan: Plan
    files: list[OutputFile]
    sharded: bool
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def describe(self) -> str:
        kind = "sharded (one file per rank)" if self.sharded else "Hugging Face"
        lines = [f"{len(self.files)} files, {kind}, {self.nbytes:,} bytes, "
                 f"{len(self.plan.destinations)} tensors"]
        for file in self.files:
            lines.append(f"  {file.filename}  {file.nbytes:,} bytes, {len(file.shards)} tensors")
            for index in file.shards:
                shard = self.plan.destinations[index]
                where = ("" if shard.local_shape == shard.global_shape else
                         f" at {list(shard.global_offset)} of {list(shard.global_shape)}")
                lines.append(f"    {shard.key}  {shard.dtype}  {list(shard.local_shape)}{where}")
        return "\n".join(lines)


def source_shard_info(checkpoint: SourceCheckpoint) -> dict[str, list[ShardDesc]]:
    return {key: [ShardDesc(s.key, s.local_shape, s.global_shape, s.global_offset, s.dtype)
                  for s in shards]
            for key, shards in checkpoint.shards.items()}


def derived_outputs(statements, source: Mapping, reverse: bool, file: str | None
                    ) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """Key -> (shape, dtype) of every output the program makes when no destination is given,
    with the optimizer states that follow it: a state every source of the output has."""
    compilation = analyze(statements, source, None, reverse=reverse, file=file,
                          passes=through(propagate_shapes))
    made = compilation.tensors.outputs
    outputs = {}
    for target in compilation.destination_shards():
        outputs[target.key] = (target.global_shape, target.dtype)
        tensor = made[target.key]
        if tensor is None:
            continue
        keys = sorted(tensor.source_keys())
        for suffix in OPTIMIZER_SUFFIXES:
            if not keys or not all(key + suffix in source for key in keys):
                continue
            if suffix in BETA_POW_SUFFIXES:
                first = source[keys[0] + suffix][0]
                outputs[target.key + suffix] = (first.global_shape, first.dtype)
                continue
            dtypes = {dtype_after(piece.ops, source[key + suffix][0].dtype)
                      for key, piece in tensor.pieces()}
            if len(dtypes) == 1:
                outputs[target.key + suffix] = (target.global_shape, dtypes.pop())
    return outputs


def prepare(statements: str | Sequence[str], checkpoint: SourceCheckpoint, *,
            layout: MeshLayout | None = None, destination: Mapping | None = None,
            reverse: bool = False, file: str | None = None,
            max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Conversion:
    """Compile and validate; decide the destination shards and the files that hold them.

    No layout and no destination: full, unsharded tensors in Hugging Face files. A layout
    (mesh and rules) or a shard-info mapping: one file per rank, with DCP sharding info
    (with a shard-info mapping, rank i holds the i-th listed shard of each key)."""
    source = source_shard_info(checkpoint)
    if layout is not None and destination is not None:
        raise UsageError("give a layout or a destination shard list, not both")
    ranks: list[list[ShardDesc]] | None = None
    destination_info: Mapping | None = destination
    if layout is not None:
        destination_info, ranks = layout.shards(derived_outputs(statements, source, reverse,
                                                                file))
    elif destination is not None:
        ranks = []
        for shards in destination.values():
            for i, shard in enumerate(shards):
                while len(ranks) <= i:
                    ranks.append([])
                ranks[i].append(ShardDesc.from_json(shard) if isinstance(shard, Mapping)
                                else shard)
    compilation = analyze(statements, source, destination_info, reverse=reverse, file=file)
    plan = compilation.plan()
    notes = [n.render() for n in compilation.ctx.notes]
    index_of: dict[int, int] = {id(shard): i for i, shard in enumerate(plan.destinations)}
    if ranks is None:
        specs = [TensorSpec(d.key, d.dtype or "float32", d.local_shape)
                 for d in plan.destinations]
        by_name = {d.key: i for i, d in enumerate(plan.destinations)}
        files = [OutputFile(f.filename, [by_name[t.name] for t in f.tensors],
                            sum(t.nbytes for t in f.tensors))
                 for f in plan_hf_files(specs, max_file_bytes)]
        return Conversion(plan, files, False, notes)
    files = []
    names = [name for name, _ in plan_rank_files([[] for _ in ranks])]
    for filename, shards in zip(names, ranks):
        indices = [index_of[id(s)] for s in shards] if layout is not None else [
            _find(plan, s) for s in shards]
        files.append(OutputFile(filename, indices,
                                sum(plan.shard_bytes(i) for i in indices)))
    return Conversion(plan, files, True, notes)


def _find(plan: Plan, shard: ShardDesc) -> int:
    for i, candidate in enumerate(plan.destinations):
        if candidate is shard or candidate == shard:
            return i
    raise AssertionError(f"{shard.key} is not in the plan")


def execute(conversion: Conversion, checkpoint: SourceCheckpoint, output: str | Path, *,
            threads: int | None = None, backend: str = "cpp",
            progress: Callable[[int], None] | None = None,
            files: Sequence[OutputFile] | None = None, write_index: bool = True,
            check_output: bool = True) -> None:
    """Write ``files`` (default: all) of the conversion into ``output``; then the index.

    Several processes can share the work: each writes its own ``files`` with
    ``write_index=False``, and one writes the index when all are done."""
    plan = conversion.plan
    buffers = {(s.key, s.global_offset): s for shards in checkpoint.shards.values()
               for s in shards}

    def stored(index: int):
        shard = plan.sources[index]
        return buffers[(shard.key, shard.global_offset)]

    executor = PlanExecutor(plan, lambda i: checkpoint.buffer(stored(i)), backend=backend,
                            threads=threads, progress=progress,
                            release=lambda i: checkpoint.release(stored(i)))
    chosen = conversion.files if files is None else list(files)
    start = time.perf_counter()
    output = Path(output)
    if check_output:
        check_output_folder(output)
    if conversion.sharded:
        rank_files = [RankFile(f.filename, [_shard_spec(plan.destinations[i]) for i in f.shards])
                      for f in chosen]
        positions = {f.filename: {plan.destinations[i].key: i for i in f.shards}
                     for f in chosen}

        def fill_shard(filename: str, spec: ShardSpec, view: memoryview) -> None:
            executor.fill([positions[filename][spec.key]], [view])

        write_sharded_checkpoint(output, rank_files, fill_shard)
    else:
        hf_files = [HfFile(f.filename, [_tensor_spec(plan.destinations[i]) for i in f.shards])
                    for f in chosen]
        by_name = {plan.destinations[i].key: i for f in chosen for i in f.shards}

        def fill_tensor(name: str, view: memoryview) -> None:
            executor.fill([by_name[name]], [view])

        write_hf_files(output, hf_files, fill_tensor)
        if write_index:
            write_hf_index(output, [HfFile(f.filename, [_tensor_spec(plan.destinations[i])
                                                        for i in f.shards])
                                    for f in conversion.files])
    conversion.seconds = time.perf_counter() - start


def _tensor_spec(shard: ShardDesc) -> TensorSpec:
    return TensorSpec(shard.key, shard.dtype or "float32", shard.local_shape)


def _shard_spec(shard: ShardDesc) -> ShardSpec:
    return ShardSpec(shard.key, shard.dtype or "float32", shard.local_shape, shard.global_offset)


def check_output_folder(output: Path) -> None:
    """Refuse a folder that already holds a checkpoint: files of two runs would mix."""
    if output.exists() and not output.is_dir():
        raise StorageError(f"{output}: the output is a file, not a folder")
    if output.is_dir() and (any(output.glob("*.safetensors")) or
                            (output / "model.safetensors.index.json").exists()):
        raise StorageError(f"{output}: the output folder already holds a checkpoint",
                           hint="Convert into an empty or new folder.")

