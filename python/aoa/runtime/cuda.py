"""Destinations on a CUDA GPU: the kernel fills pinned host staging buffers, CuPy sends them.

Each device shard is cut into slabs of whole rows (axis 0) that fit a staging buffer, and
slabs are packed into batches. Two pinned buffers take turns: while the GPU copies one
batch out of a buffer (asynchronously, on a stream of its own), the kernel fills the next
batch into the other, reading straight from the source files' mappings; an event per
buffer says when it may be filled again. So reading, copying and transferring overlap.

A shard whose copies all widen one narrow dtype exactly (bfloat16 -> float32, ...) is
staged and sent in the narrow dtype and widened on the GPU, into place: half the bytes
cross the bus. Every GPU call goes through `CupyTransfer`; nothing here needs CUDA to build,
and a stand-in with the same methods runs this module's logic on a machine with no GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from math import prod
from typing import Any, Protocol

import numpy as np

from aoa.dtypes import itemsize
from aoa.layout import ShardDesc
from aoa.plan import Plan, PlannedCopy
from aoa.runtime.buffers import DeviceBuffer
from aoa.runtime.executor import Buffer, PlanExecutor, SourceExtents
from aoa.runtime.lower import cut_rows, rows_of
from aoa.storage.formats import Piece

#: Bytes of one pinned staging buffer (there are two); a larger single row gets its size.
DEFAULT_STAGING_BYTES = 64 << 20
#: Staging offsets are aligned to this many bytes.
_ALIGN = 256

#: (narrow, wide) casts that are exact and that the GPU does after the transfer, with the
#: CUDA code of one element (bfloat16 travels as its uint16 bits: no CuPy dtype needed).
WIDENINGS: dict[tuple[str, str], tuple[str, str, str]] = {
    ("bfloat16", "float32"): ("uint16 x", "float32 y",
                              "y = __uint_as_float(((unsigned int)x) << 16)"),
    ("bfloat16", "float64"): ("uint16 x", "float64 y",
                              "y = (double)__uint_as_float(((unsigned int)x) << 16)"),
    ("float16", "float32"): ("float16 x", "float32 y", "y = (float)x"),
    ("float16", "float64"): ("float16 x", "float64 y", "y = (double)(float)x"),
    ("float32", "float64"): ("float32 x", "float64 y", "y = (double)x"),
}


class Transfer(Protocol):
    """The GPU calls the staging pipeline makes (CuPy's, or a stand-in in tests)."""

    def device(self, device: int) -> AbstractContextManager: ...
    def pinned(self, nbytes: int) -> np.ndarray: ...
    def scratch(self, nbytes: int) -> int: ...
    def stream(self) -> object: ...
    def to_device(self, pointer: int, host: np.ndarray, stream: object) -> None: ...
    def widen(self, source: int, pointer: int, pair: tuple[str, str], count: int,
              stream: object) -> None: ...
    def record(self, stream: object) -> object: ...
    def wait(self, event: object) -> None: ...
    def synchronize(self, stream: object) -> None: ...


@dataclass(frozen=True)
class Slab:
    """Rows ``rows`` (of axis 0) of destination shard ``shard``: staged in ``dtype`` (the
    shard's, or a narrower one widened on the GPU), sent to ``pointer``."""

    shard: int
    rows: tuple[int, int]
    dtype: str
    pointer: int
    nbytes: int  # staged bytes
    filled: int  # bytes of the destination these rows fill


def transfer_dtype(plan: Plan, copies: Sequence[PlannedCopy], dtype: str) -> str:
    """The dtype to send a shard in: one narrow source dtype that every copy widens exactly
    to ``dtype`` (and the GPU can widen), else ``dtype`` itself."""
    sources = {plan.sources[c.source].dtype or "float32" for c in copies}
    if len(sources) != 1 or any(c.casts or c.source in plan.scales for c in copies):
        return dtype  # (a quantized source is dequantized on the host, by the kernel)
    narrow = sources.pop()
    return narrow if (narrow, dtype) in WIDENINGS else dtype


def staged_plan(plan: Plan, targets: Mapping[int, DeviceBuffer], staging_bytes: int
                ) -> tuple[Plan, list[Slab]]:
    """A plan whose destinations are the slabs of ``targets`` (plan index -> device buffer)
    in their transfer dtypes, with each copy cut to the rows of its slab."""
    by_destination = plan.copies_by_destination()
    untouched = set(plan.untouched)
    slab_descs: list[ShardDesc] = []
    slab_copies: list[PlannedCopy] = []
    slabs: list[Slab] = []
    for index, target in targets.items():
        shard = plan.destinations[index]
        copies = by_destination[index]
        if index in untouched or not target.nbytes:
            continue
        dtype = shard.dtype or "float32"
        staged = transfer_dtype(plan, copies, dtype)
        shape = shard.local_shape
        rows = shape[0] if shape else 1
        row_items = prod(shape[1:]) if shape else 1
        step = max(1, staging_bytes // (row_items * itemsize(staged)))
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            slab_index = len(slab_descs)
            slab_descs.append(rows_of(shard, start, stop, staged))
            slab_copies += [_moved(c, slab_index) for c in cut_rows(copies, start, stop)]
            count = (stop - start) * row_items
            slabs.append(Slab(index, (start, stop), staged,
                              target.pointer + start * row_items * itemsize(dtype),
                              count * itemsize(staged), count * itemsize(dtype)))
    return Plan(plan.sources, slab_descs, slab_copies, scales=plan.scales), slabs


def _moved(c: PlannedCopy, destination: int) -> PlannedCopy:
    return PlannedCopy(destination, c.destination_start, c.shape, c.source, c.source_start,
                       c.order, c.casts)


def batches(slabs: Sequence[Slab], staging_bytes: int) -> list[list[tuple[int, int]]]:
    """Slabs packed in order into batches of at most ``staging_bytes`` (or one slab, when
    a slab is larger): (slab index, byte offset in the staging buffer) each."""
    result: list[list[tuple[int, int]]] = []
    end = 0
    for index, slab in enumerate(slabs):
        offset = -(-end // _ALIGN) * _ALIGN
        if not result or offset + slab.nbytes > staging_bytes:
            result.append([])
            offset = 0
        result[-1].append((index, offset))
        end = offset + slab.nbytes
    return result


def fill_device(plan: Plan, targets: Mapping[int, DeviceBuffer],
                source_buffer: Callable[[int], Buffer], *, backend: str = "cpp",
                threads: int | None = None, progress: Callable[[int], None] | None = None,
                staging_bytes: int = DEFAULT_STAGING_BYTES,
                transfer: Transfer | None = None,
                source_extents: SourceExtents | None = None) -> None:
    """Fill the device buffers ``targets`` (plan destination index -> buffer), one device
    at a time; returns once every byte is on its GPU. ``source_extents``: where the source
    shards lie, to read a cold source ahead of the batches (`PlanExecutor`)."""
    if transfer is None:
        transfer = CupyTransfer()
    devices: dict[int, dict[int, DeviceBuffer]] = {}
    for index, target in targets.items():
        devices.setdefault(target.device, {})[index] = target
    for device, on_device in sorted(devices.items()):
        with transfer.device(device):
            _fill_one_device(plan, on_device, source_buffer, backend, threads, progress,
                             staging_bytes, transfer, source_extents)


def _fill_one_device(plan, targets, source_buffer, backend, threads, progress,
                     staging_bytes, transfer: Transfer,
                     source_extents: SourceExtents | None = None) -> None:
    staged, slabs = staged_plan(plan, targets, staging_bytes)
    if not slabs:
        return
    size = max(staging_bytes, max(slab.nbytes for slab in slabs))
    plan_batches = batches(slabs, size)
    executor = PlanExecutor(staged, source_buffer, backend=backend, threads=threads,
                            source_extents=source_extents)
    try:
        executor.expect(np.arange(len(slabs), dtype=np.int64))  # the batches' order
        _send_batches(plan, slabs, plan_batches, size, executor, transfer, progress)
    finally:
        executor.close()


def _send_batches(plan: Plan, slabs: list[Slab],
                  plan_batches: list[list[tuple[int, int]]], size: int,
                  executor: PlanExecutor, transfer: Transfer,
                  progress: Callable[[int], None] | None) -> None:
    """Fill the batches in turn through two pinned buffers, each sent to its slabs."""
    buffers = [transfer.pinned(size) for _ in range(min(2, len(plan_batches)))]
    narrow = any(slab.dtype != (plan.destinations[slab.shard].dtype or "float32")
                 for slab in slabs)
    scratch = transfer.scratch(size) if narrow else 0
    stream = transfer.stream()
    events: list[object | None] = [None] * len(buffers)
    for number, batch in enumerate(plan_batches):
        slot = number % len(buffers)
        if events[slot] is not None:
            transfer.wait(events[slot])  # the GPU is done reading this buffer
        host = buffers[slot]
        views = [host[offset:offset + slabs[i].nbytes] for i, offset in batch]
        executor.fill([Piece(i, view) for (i, _), view in zip(batch, views)])
        for (i, offset), view in zip(batch, views):
            slab = slabs[i]
            wide = plan.destinations[slab.shard].dtype or "float32"
            if slab.dtype == wide:
                transfer.to_device(slab.pointer, view, stream)
            else:
                transfer.to_device(scratch + offset, view, stream)
                transfer.widen(scratch + offset, slab.pointer, (slab.dtype, wide),
                               slab.nbytes // itemsize(slab.dtype), stream)
        events[slot] = transfer.record(stream)
        if progress is not None:
            progress(sum(slabs[i].filled for i, _ in batch))
    transfer.synchronize(stream)


class CupyTransfer:
    """`Transfer` through CuPy: pinned memory, one non-blocking stream, raw memcpyAsync."""

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self._kernels: dict[tuple[str, str], Any] = {}
        self._keep: list[object] = []  # device scratch, pinned memory: alive until done

    def device(self, device: int) -> AbstractContextManager:
        return self.cupy.cuda.Device(device)

    def pinned(self, nbytes: int) -> np.ndarray:
        memory = self.cupy.cuda.alloc_pinned_memory(nbytes)
        self._keep.append(memory)
        return np.frombuffer(memory, np.uint8, nbytes)

    def scratch(self, nbytes: int) -> int:
        memory = self.cupy.cuda.alloc(nbytes)
        self._keep.append(memory)
        return int(memory.ptr)

    def stream(self) -> object:
        # Work already queued on this device (a framework zero-filling the destinations on
        # its own stream, say) finishes first: the new stream is not ordered after it.
        self.cupy.cuda.runtime.deviceSynchronize()
        return self.cupy.cuda.Stream(non_blocking=True)

    def to_device(self, pointer: int, host: np.ndarray, stream) -> None:
        runtime = self.cupy.cuda.runtime
        runtime.memcpyAsync(pointer, host.ctypes.data, host.nbytes,
                            runtime.memcpyHostToDevice, stream.ptr)

    def widen(self, source: int, pointer: int, pair: tuple[str, str], count: int,
              stream) -> None:
        inputs, outputs, code = WIDENINGS[pair]
        kernel = self._kernels.get(pair)
        if kernel is None:
            kernel = self._kernels[pair] = self.cupy.ElementwiseKernel(
                inputs, outputs, code, f"aoa_widen_{pair[0]}_{pair[1]}")
        with stream:
            kernel(self._array(source, count, inputs.split()[0]),
                   self._array(pointer, count, outputs.split()[0]))

    def _array(self, pointer: int, count: int, dtype: str):
        cupy = self.cupy
        nbytes = count * np.dtype(dtype).itemsize
        memory = cupy.cuda.UnownedMemory(pointer, nbytes, self)
        return cupy.ndarray((count,), dtype, cupy.cuda.MemoryPointer(memory, 0))

    def record(self, stream) -> object:
        return stream.record()

    def wait(self, event) -> None:
        event.synchronize()

    def synchronize(self, stream) -> None:
        stream.synchronize()
