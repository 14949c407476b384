"""`aoa.load`: a checkpoint, through a mapping, straight into the caller's arrays and tensors.

The destination shard descriptions come from the buffers themselves (shape, dtype, and for
an `aoa.Shard` its place in the global tensor); the mapping is compiled against them and
validated, then the plan's copies run into the buffers: in place for a C-contiguous host
buffer, through pinned staging for a CUDA one (runtime/cuda.py). Under torch.distributed
every rank gathers every rank's shard descriptions, compiles the same plan, and runs only
the copies of its own shards, reading the shared checkpoint folder directly.

    model = {"lm_head.weight": torch.empty(1024, 256, dtype=torch.bfloat16)}
    aoa.load("hf_to_fused.aoa", source="ckpt/", into=model)
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from aoa.errors import AoaError, UsageError, ValidationError
from aoa.jobs.job import Job, ShardInfo, compile_mapping, plan_job
from aoa.layout import ShardDesc, as_box, distinct_boxes, split_optimizer_suffix, tiling_fault
from aoa.mapping import MappingText, as_mapping
from aoa.pipeline import Compilation
from aoa.plan import Plan
from aoa.runtime.buffers import Adapted, DeviceBuffer, HostBuffer, adapt, overlapping
from aoa.runtime.progress import progress_bar
from aoa.storage.formats import Piece, Source, opened

#: Host shards are filled in groups of about this many bytes (one kernel call each).
_GROUP_BYTES = 256 << 20


@dataclass(frozen=True)
class Shard:
    """``buffer`` holds one box of a larger tensor: the box at ``global_offset`` (default:
    zeros) of a tensor of ``global_shape``; the box's shape is the buffer's."""

    buffer: object
    global_shape: Sequence[int]
    global_offset: Sequence[int] | None = None


@dataclass
class Loaded:
    """What `load` did: the plan every rank compiled and the part this process ran."""

    plan: Plan
    #: indices into ``plan.destinations`` of the shards this process filled
    filled: list[int]
    nbytes: int
    compile_seconds: float
    seconds: float
    notes: list[str] = field(default_factory=list)
    #: the source shards this process read from (a rank reads only what its shards need)
    sources_read: list[ShardDesc] = field(default_factory=list)


@dataclass
class _Target:
    desc: ShardDesc
    buffer: Adapted


Targets = Mapping[str, object]


def load(mapping: str | os.PathLike[str] | Sequence[str] | MappingText,
         source: str | os.PathLike[str] | Source, into: Targets, *,
         destination: Mapping[str, Sequence[ShardDesc]] | None = None,
         reverse: bool = False, threads: int | None = None, progress: bool = True,
         distributed: bool | None = None, group: object = None,
         backend: str = "cpp", source_format: str | None = None,
         strict: bool = True) -> Loaded:
    """Fill the buffers of ``into`` from the checkpoint ``source`` through ``mapping``.

    ``mapping``: a `.aoa` or JSON file, AOA text, or a list of statements. ``source``: a
    checkpoint folder or file (its format detected, or named by ``source_format``), or one
    opened with `aoa.storage.open_source`. ``into``: destination key -> a buffer (numpy
    array, torch tensor, CuPy array, ...) for the whole tensor, an `aoa.Shard` for one box
    of it, or a list of those. A key gets what a statement writes to it, else the source key
    of the same name (Paddle's rule). Buffers that are the same memory (tied weights, as
    ``model.state_dict()`` holds an embedding and the head that shares it) are filled once.

    ``distributed``: None uses torch.distributed when it is initialized with more than one
    rank (every rank must call load then); False loads in this process alone. ``destination``
    gives the whole destination layout when the buffers here hold only part of it (the
    shard counts decide fused layouts); by default it is the shards of all ranks' buffers.
    ``strict`` (default) refuses likely mistakes in the mapping; False keeps Paddle's
    meaning (`aoa.passes.context.CompileContext`).
    Raises ValidationError naming the key when buffers and mapping disagree."""
    text = as_mapping(mapping)
    text = text._replace(reverse=reverse or text.reverse)
    given = destination
    world = _world(distributed, group) if destination is None else None
    with contextlib.ExitStack() as stack:
        error: AoaError | None = None
        targets: list[_Target] = []
        tied: dict[str, str] = {}
        try:
            checkpoint = stack.enter_context(opened(source, source_format))
            start = time.perf_counter()
            made = compile_mapping(text, checkpoint.shards, plan=False, strict=strict)
            compiled = time.perf_counter() - start
            targets, tied = _untie(_targets(into), made)
            _check_apart(targets)
        except AoaError as failure:
            if world is None:
                raise
            error = failure  # said to the other ranks first, so that none waits for this one
        local = [t.desc for t in targets]
        if destination is not None:
            own = _find_own(destination, local)
        elif world is not None:
            from aoa.jobs.distributed import gather_shards

            destination, positions = _merge(gather_shards(local, error, group))
            own = positions[world[0]]
        else:
            destination, positions = _merge([local])
            own = positions[0]
        if given is None:
            _check_coverage(destination, world is not None)
        start = time.perf_counter()
        _check_keys(made, destination, tied)
        job = plan_job(text, checkpoint, destination, strict=strict)
        compiled += time.perf_counter() - start
        plan = job.plan
        first = _first_indices(destination)
        indices = [first[key] + position for key, position in own]
        for index, target in zip(indices, targets):
            if plan.destinations[index] != target.desc:  # the compiler keeps their order
                raise AssertionError(f"plan destination {index} is not {target.desc}")
        start = time.perf_counter()
        if threads is None and world is not None:
            from aoa.jobs.distributed import threads_per_rank

            threads = threads_per_rank()
        read: dict[int, ShardDesc] = {}
        show = progress and (world is None or world[0] == 0)
        with progress_bar(sum(t.buffer.nbytes for t in targets), "loading", show=show,
                          terminal_only=True) as advance:
            _execute(job, list(zip(indices, (t.buffer for t in targets))), read,
                     threads=threads, backend=backend, progress=advance)
        seconds = time.perf_counter() - start
    notes = [f"note: the buffer for '{key}' is the same memory as the one for '{kept}' (tied "
             f"weights): filled once, as '{kept}'" for key, kept in tied.items()]
    return Loaded(plan, indices, sum(t.buffer.nbytes for t in targets), compiled, seconds,
                  notes + job.notes, [read[i] for i in sorted(read)])


# -- the buffers ---------------------------------------------------------------------------


def _targets(into: Targets) -> list[_Target]:
    if not isinstance(into, Mapping):
        raise UsageError(f"into must map destination keys to buffers, not "
                         f"{type(into).__name__}")
    targets = []
    for key, value in into.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            targets.append(_target(key, item))
    return targets


def _target(key: str, item: object) -> _Target:
    what = f"the buffer for '{key}'"
    if isinstance(item, Shard):
        buffer = adapt(item.buffer, what)
        global_shape = as_box(key, "global_shape", item.global_shape)
        offset = (as_box(key, "global_offset", item.global_offset)
                  if item.global_offset is not None else (0,) * len(global_shape))
    else:
        buffer = adapt(item, what)
        global_shape, offset = buffer.shape, (0,) * len(buffer.shape)
    local = buffer.shape
    if not len(local) == len(global_shape) == len(offset):
        raise UsageError(f"{what} has shape {list(local)}, but its global shape "
                         f"{list(global_shape)} and offset {list(offset)} have "
                         f"{len(global_shape)} and {len(offset)} axes")
    for axis, (start, size, total) in enumerate(zip(offset, local, global_shape)):
        if start < 0 or start + size > total:
            raise UsageError(f"{what} reaches past its global shape on axis {axis}: offset "
                             f"{start} + size {size} > {total}")
    return _Target(ShardDesc(key, local, global_shape, offset, buffer.dtype), buffer)


def _untie(targets: list[_Target], made: Compilation
           ) -> tuple[list[_Target], dict[str, str]]:
    """Buffers that are the same memory (one shape, dtype and box at one place: tied
    weights) filled once, as the first of their keys the mapping makes; the others are left
    out. Returns the targets kept and, for each key left out, the key it is filled as."""
    by_place: dict[tuple, list[_Target]] = {}
    for target in targets:
        buffer = target.buffer
        if buffer.place is not None and buffer.nbytes:
            desc = target.desc
            by_place.setdefault((buffer.place, desc.local_shape, desc.dtype), []).append(target)
    dropped: set[int] = set()
    tied: dict[str, str] = {}
    for group in by_place.values():
        if len({target.desc.key for target in group}) < 2:
            continue
        boxes = {(t.desc.global_shape, t.desc.global_offset) for t in group}
        keys = list(dict.fromkeys(t.desc.key for t in group))
        if len(boxes) > 1:
            raise ValidationError(
                f"the buffers for {_listed(keys)} are the same memory, but stand for "
                "different boxes of their tensors",
                hint="Tied weights share one buffer for one box; give the others buffers of "
                     "their own.")
        kept = next((key for key in keys if _made(made, key)), None)
        if kept is None:
            raise ValidationError(
                f"the buffers for {_listed(keys)} are the same memory (tied weights), but "
                "the mapping makes none of them, and the source has no key of those names",
                hint=f"Map a source key to one of them (`some.key -> {keys[0]}`).")
        for target in group:
            if target.desc.key != kept:
                dropped.add(id(target))
                tied[target.desc.key] = kept
    return [t for t in targets if id(t) not in dropped], tied


def _check_apart(targets: Sequence[_Target]) -> None:
    """No two buffers share memory but tied ones (`_untie`) and one box given twice: both
    would be written, and one would keep the other's bytes."""
    found = overlapping([t.buffer for t in targets], [t.desc for t in targets])
    if found is None:
        return
    one, other = (targets[i].desc for i in found)
    if one.key == other.key:
        what = (f"two buffers for '{one.key}' (the boxes at {list(one.global_offset)} and "
                f"{list(other.global_offset)})")
    else:
        what = f"the buffers for '{one.key}' and '{other.key}'"
    raise ValidationError(f"{what} share memory: each would be written over the other",
                          hint="Give each box its own memory; tied weights share a buffer "
                               "as one tensor, of one shape at one place.")


def _made(made: Compilation, key: str) -> bool:
    try:
        return made.made_as(split_optimizer_suffix(key)[0]) is not None
    except KeyError:
        return False


def _listed(keys: Sequence[str]) -> str:
    quoted = [f"'{key}'" for key in keys]
    return ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _merge(ranks: Sequence[Sequence[ShardDesc]]
           ) -> tuple[dict[str, list[ShardDesc]], list[list[tuple[str, int]]]]:
    """All ranks' shards by key, rank 0's first; and where each rank's shards landed
    (key, position in that key's list)."""
    merged: dict[str, list[ShardDesc]] = {}
    positions: list[list[tuple[str, int]]] = []
    for shards in ranks:
        mine = []
        for shard in shards:
            listed = merged.setdefault(shard.key, [])
            mine.append((shard.key, len(listed)))
            listed.append(shard)
        positions.append(mine)
    return merged, positions


def _check_coverage(destination: Mapping[str, Sequence[ShardDesc]], ranks: bool) -> None:
    """The buffers of each key, together, tile its global tensor (a replica counts once):
    the destination layout is all of them, and its shard counts decide fused layouts
    (fused_qkv, fused_ffn)."""
    where = "all ranks' buffers" if ranks else "the buffers"
    for key, shards in destination.items():
        distinct = [shards[i] for i in distinct_boxes(shards)]
        shape = shards[0].global_shape
        fault = tiling_fault(shape, distinct)
        if fault is None:
            continue
        if fault.overlap is not None:
            one, other = (distinct[i] for i in fault.overlap)
            raise ValidationError(
                f"{where} for '{key}' overlap: the shard at {list(one.global_offset)} and the "
                f"one at {list(other.global_offset)} share elements of its global shape "
                f"{list(shape)}",
                hint="Give each box of the tensor one buffer (replicas: the very same box).")
        raise ValidationError(
            f"{where} for '{key}' cover {fault.covered} of the {fault.total} elements of its "
            f"global shape {list(shape)}",
            hint="Give the whole destination layout with destination= (every rank's "
                 "shards), or load under torch.distributed, where all ranks' shards count.")


def _find_own(destination: Mapping[str, Sequence[ShardDesc]], local: Sequence[ShardDesc]
              ) -> list[tuple[str, int]]:
    """Where each local shard is in a destination layout given by the caller."""
    own = []
    for shard in local:
        listed = list(destination.get(shard.key, ()))
        for position, candidate in enumerate(listed):
            if (candidate.local_shape, candidate.global_shape, candidate.global_offset) == (
                    shard.local_shape, shard.global_shape, shard.global_offset):
                own.append((shard.key, position))
                break
        else:
            raise ValidationError(
                f"the buffer for '{shard.key}' (shape {list(shard.local_shape)} at "
                f"{list(shard.global_offset)} of {list(shard.global_shape)}) is not one of the "
                "shards the destination layout lists for it")
    return own


def _first_indices(destination: Mapping[str, Sequence[ShardDesc]]) -> dict[str, int]:
    """Where each key's shards start among the plan's destinations: the compiler lists the
    destination layout's shards key by key, in order."""
    first, index = {}, 0
    for key, shards in destination.items():
        first[key] = index
        index += len(shards)
    return first


# -- checks against the mapping --------------------------------------------------------------


def _check_keys(made: Compilation, destination: ShardInfo, tied: Mapping[str, str]) -> None:
    """Every buffer is for a tensor the mapping makes (``made``: compiled without a
    destination; a key gets what a statement writes to it, else the source key of that
    name), with its global shape and dtype, and every tensor the mapping makes on its own has
    a buffer (optimizer states are optional; a key ``tied`` to another is filled as it)."""
    wanted: dict[str, ShardDesc | None] = {}
    for key, shards in destination.items():
        model_key, suffix = split_optimizer_suffix(key)
        try:
            want = made.made_as(model_key)
        except KeyError:
            unfilled = sorted(set(made.tensors.outputs) - set(destination) - set(tied))
            import difflib  # (for this message only)

            close = difflib.get_close_matches(key, unfilled, n=1)
            raise ValidationError(
                f"'{key}' has a buffer, but no statement writes it and the source has no key "
                "of that name",
                hint=f"Did you mean '{close[0]}', which the mapping makes and no buffer is "
                     f"given for?" if close else
                f"Map a source key to it (`some.key -> {model_key}`), or give no buffer for "
                "it.") from None
        wanted[key] = want
        if want is None or suffix is not None:
            continue  # declared with `_ -> key`, or an optimizer state: the compiler checks
        for shard in shards:
            whole = shard.local_shape == shard.global_shape and not any(shard.global_offset)
            if shard.global_shape != want.global_shape:
                what = (f"has shape {list(shard.global_shape)}" if whole else
                        f"is a shard of global shape {list(shard.global_shape)}")
                raise ValidationError(
                    f"the buffer for '{key}' {what}, but the mapping makes "
                    f"{list(want.global_shape)}",
                    hint="Give a buffer of the shape the mapping makes, or change the mapping "
                         "(a missing ^T or permute?).")
            if want.dtype is not None and shard.dtype != want.dtype:
                raise ValidationError(
                    f"the buffer for '{key}' is {shard.dtype}, but the mapping makes "
                    f"{want.dtype}",
                    hint=f"Give a {want.dtype} buffer, or cast in the mapping: "
                         f"`... -> {key}, dtype='{shard.dtype}'`.")
    missing = sorted(key for key, tensor in made.outputs().items()
                     if tensor is not None and key not in destination and key not in tied)
    if missing:
        shown = ", ".join(f"'{k}'" for k in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValidationError(
            f"the mapping makes {shown}{more}, but no buffer is given for "
            f"{'it' if len(missing) == 1 else 'them'}",
            hint="Give every tensor the mapping makes a buffer, or delete what you do not "
                 "want in the mapping (`source.key -> _`).")


# -- running the copies ----------------------------------------------------------------------


def _execute(job: Job, targets: list[tuple[int, Adapted]], read: dict[int, ShardDesc], *,
             threads: int | None, backend: str,
             progress: Callable[[int], None] | None) -> None:
    host = [(i, b) for i, b in targets if isinstance(b, HostBuffer)]
    device = {i: b for i, b in targets if isinstance(b, DeviceBuffer)}
    if host:
        executor = job.executor(backend=backend, threads=threads, read=read,
                                release_pages=False)
        try:
            import numpy as np

            executor.expect(np.array([i for i, _ in host], np.int64))  # a cold source ahead
            for group in _groups(host):
                executor.fill([Piece(i, b.data) for i, b in group])
                for _, buffer in group:
                    if buffer.finish is not None:
                        buffer.finish()
                if progress is not None:
                    progress(sum(b.nbytes for _, b in group))
        finally:
            executor.close()
    if device:
        from aoa.runtime.cuda import fill_device

        fill_device(job.plan, device, job.source_buffer(read), backend=backend,
                    threads=threads, progress=progress,
                    source_extents=job.source.plan_extents(job.plan.sources))


def _groups(host: list[tuple[int, HostBuffer]]) -> list[list[tuple[int, HostBuffer]]]:
    groups: list[list[tuple[int, HostBuffer]]] = [[]]
    size = 0
    for item in host:
        if groups[-1] and size + item[1].nbytes > _GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[1].nbytes
    return groups


# -- small parts -----------------------------------------------------------------------------


def _world(distributed: bool | None, group: object) -> tuple[int, int] | None:
    """(rank, world size) when loading across ranks, else None."""
    if distributed is False:
        return None
    from aoa.jobs.distributed import world

    found = world(group)
    if distributed and found is None:
        raise UsageError("distributed=True, but torch.distributed is not initialized",
                         hint="Call torch.distributed.init_process_group first (torchrun "
                              "sets up the environment it reads).")
    return found if found is not None and found[1] > 1 else None
