"""CUDA destinations: pinned staging, double buffering, narrow transfers widened on the GPU.

The staging pipeline runs here twice: over `HostTransfer`, a stand-in whose "device" is host
memory and whose copies happen only when an event is waited on (so a staging buffer filled
again too early gives wrong bytes), on every machine; and over CuPy on a real GPU, in the
tests marked `cuda`, which skip where CuPy or a device is missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors_files import save_folder

import aoa
from aoa.dtypes import itemsize, numpy_dtype
from aoa.layout import ShardDesc
from aoa.runtime import buffers, cuda

# -- the stand-in ------------------------------------------------------------------------------


def _host_array(pointer: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(pointer))


class HostTransfer:
    """`cuda.Transfer` over host memory. Copies and widenings queue on the stream and run
    when an event is waited on or the stream synchronized, as a GPU's would run later."""

    def __init__(self) -> None:
        self.pending: list[tuple] = []
        self.done = 0
        self.keep: list[np.ndarray] = []
        self.pinned_sizes: list[int] = []
        self.sent: list[tuple[int, int]] = []  # (destination pointer, bytes) per copy
        self.widened: list[tuple[str, str]] = []

    def device(self, device: int):
        return contextlib.nullcontext()

    def pinned(self, nbytes: int) -> np.ndarray:
        self.pinned_sizes.append(nbytes)
        self.keep.append(np.zeros(nbytes, np.uint8))
        return self.keep[-1]

    def scratch(self, nbytes: int) -> int:
        self.keep.append(np.zeros(nbytes, np.uint8))
        return self.keep[-1].ctypes.data

    def stream(self) -> object:
        return "stream"

    def to_device(self, pointer: int, host: np.ndarray, stream) -> None:
        self.sent.append((pointer, host.nbytes))
        self.pending.append(("copy", pointer, host))

    def widen(self, source: int, pointer: int, pair, count: int, stream) -> None:
        self.widened.append(pair)
        self.pending.append(("widen", source, pointer, pair, count))

    def record(self, stream) -> int:
        return len(self.pending)

    def wait(self, event: int) -> None:
        while self.done < event:
            operation = self.pending[self.done]
            if operation[0] == "copy":
                _, pointer, host = operation
                _host_array(pointer, host.nbytes)[:] = host
            else:
                _, source, pointer, (narrow, wide), count = operation
                values = _host_array(source, count * itemsize(narrow)).view(numpy_dtype(narrow))
                target = _host_array(pointer, count * itemsize(wide)).view(numpy_dtype(wide))
                target[:] = values.astype(numpy_dtype(wide))
            self.done += 1

    def synchronize(self, stream) -> None:
        self.wait(len(self.pending))


# -- a small program over in-memory sources ------------------------------------------------------

MAPPING = """\
w^T -> wt
s^T -> st
a, b -> ab, axis=1
h -> hf, dtype='float32'
"""


@pytest.fixture
def program():
    """(sources as key -> list of (offset, array)), and the expected outputs by numpy."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((7, 5), dtype=np.float32)
    s = rng.standard_normal((6, 9), dtype=np.float32)
    a = rng.standard_normal((10, 2), dtype=np.float32)
    b = rng.standard_normal((10, 3), dtype=np.float32)
    h = rng.standard_normal((11, 4), dtype=np.float32).astype(ml_dtypes.bfloat16)
    n = np.arange(6, dtype=np.int32)
    sources = {"w": [((0, 0), w)], "s": [((0, 0), s[:4]), ((4, 0), s[4:])],
               "a": [((0, 0), a)], "b": [((0, 0), b)], "h": [((0, 0), h)], "n": [((0,), n)]}
    expected = {"wt": w.T, "st": s.T, "ab": np.concatenate([a, b], axis=1),
                "hf": h.astype(np.float32), "n": n}
    return sources, {k: np.ascontiguousarray(v) for k, v in expected.items()}


def _name(array: np.ndarray) -> str:
    from aoa.dtypes import NUMPY_DTYPES

    return next(name for name, d in NUMPY_DTYPES.items() if d == array.dtype)


def compile_program(sources, expected):
    source = {key: [ShardDesc(key, part.shape, _global_shape(parts), offset, _name(part))
                    for offset, part in parts]
              for key, parts in sources.items()}
    destination = {key: [ShardDesc.full(key, v.shape, _name(v))] for key, v in expected.items()}
    plan = aoa.compile(MAPPING, source, destination)
    stored = {(key, offset): part for key, parts in sources.items() for offset, part in parts}
    return plan, lambda i: stored[(plan.sources[i].key, plan.sources[i].global_offset)]


def _global_shape(parts) -> tuple[int, ...]:
    ends = [tuple(o + n for o, n in zip(offset, part.shape)) for offset, part in parts]
    return tuple(map(max, zip(*ends)))


def device_targets(plan, outputs):
    return {i: buffers.DeviceBuffer(d.local_shape, d.dtype, outputs[d.key].ctypes.data, 0,
                                    "host stand-in", outputs[d.key])
            for i, d in enumerate(plan.destinations)}


@pytest.mark.parametrize("staging_bytes", [64, 100, 1000, 1 << 20])
def test_staging_gives_numpys_bytes(program, staging_bytes):
    sources, expected = program
    plan, source_buffer = compile_program(sources, expected)
    outputs = {k: np.full(v.shape, 9, v.dtype) for k, v in expected.items()}
    transfer = HostTransfer()
    filled = []
    cuda.fill_device(plan, device_targets(plan, outputs), source_buffer,
                     staging_bytes=staging_bytes, transfer=transfer, progress=filled.append)
    for key, want in expected.items():
        assert outputs[key].tobytes() == want.tobytes(), key
    assert sum(filled) == sum(v.nbytes for v in expected.values())
    assert len(transfer.pinned_sizes) <= 2  # double-buffered, not one buffer per batch
    assert transfer.done == len(transfer.pending)


def test_widening_casts_travel_narrow(program):
    sources, expected = program
    plan, source_buffer = compile_program(sources, expected)
    outputs = {k: np.zeros(v.shape, v.dtype) for k, v in expected.items()}
    transfer = HostTransfer()
    cuda.fill_device(plan, device_targets(plan, outputs), source_buffer, staging_bytes=40,
                     transfer=transfer)
    assert outputs["hf"].tobytes() == expected["hf"].tobytes()
    start, end = outputs["hf"].ctypes.data, outputs["hf"].ctypes.data + outputs["hf"].nbytes
    sent_to_hf = sum(n for pointer, n in transfer.sent if start <= pointer < end)
    assert sent_to_hf == 0  # bfloat16 goes to scratch, and is widened into place
    assert set(transfer.widened) == {("bfloat16", "float32")}
    assert sum(n for _, n in transfer.sent) == sum(
        v.nbytes for k, v in expected.items() if k != "hf") + expected["hf"].size * 2


def test_slabs_cut_copies_by_rows(program):
    sources, expected = program
    plan, _ = compile_program(sources, expected)
    index = next(i for i, d in enumerate(plan.destinations) if d.key == "st")
    target = {index: buffers.DeviceBuffer((9, 6), "float32", 1 << 20, 0, "x", None)}
    staged, slabs = cuda.staged_plan(plan, target, staging_bytes=3 * 6 * 4)
    assert [s.rows for s in slabs] == [(0, 3), (3, 6), (6, 9)]
    assert [s.pointer - (1 << 20) for s in slabs] == [0, 72, 144]
    assert [d.local_shape for d in staged.destinations] == [(3, 6)] * 3
    # each slab reads both source chunks of s (rows 0:4 and 4:6 of s are columns of st)
    assert [sorted(staged.sources[c.source].global_offset for c in staged.copies
                   if c.destination == k) for k in range(3)] == [[(0, 0), (4, 0)]] * 3


def test_transfer_dtype_only_for_exact_gpu_widenings(program):
    sources, expected = program
    plan, _ = compile_program(sources, expected)
    by_destination = plan.copies_by_destination()
    dtypes = {d.key: cuda.transfer_dtype(plan, by_destination[i], d.dtype)
              for i, d in enumerate(plan.destinations)}
    assert dtypes == {"wt": "float32", "st": "float32", "ab": "float32", "hf": "bfloat16",
                      "n": "int32"}


def test_batches_pack_small_slabs_and_align():
    slabs = [cuda.Slab(i, (0, 1), "float32", 0, n, n) for i, n in enumerate([10, 300, 700, 50])]
    assert cuda.batches(slabs, 1024) == [[(0, 0), (1, 256)], [(2, 0), (3, 768)]]


class FakeCudaArray:
    """A 'device' buffer as a CUDA library would offer it, over host memory."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.__cuda_array_interface__ = {
            "shape": array.shape, "typestr": array.dtype.str, "version": 3,
            "data": (array.ctypes.data, False), "strides": None}


def test_load_sends_device_buffers_through_staging(tmp_path, monkeypatch):
    """aoa.load with host and 'device' buffers together: the device ones go through the
    staging pipeline (here over the stand-in), the host ones straight into place."""
    rng = np.random.default_rng(5)
    tensors = {"w": rng.standard_normal((6, 4), dtype=np.float32),
               "h": rng.standard_normal((5, 3), dtype=np.float32).astype(ml_dtypes.bfloat16)}
    save_folder(tmp_path, tensors)
    transfer = HostTransfer()
    monkeypatch.setattr(buffers, "_device_of", lambda pointer: 0)
    monkeypatch.setattr(cuda, "CupyTransfer", lambda: transfer)
    on_device = np.zeros((4, 6), np.float32)
    on_host = np.zeros((5, 3), np.float32)
    aoa.load("w^T -> wt\nh -> hf, dtype='float32'", source=tmp_path,
             into={"wt": FakeCudaArray(on_device), "hf": on_host}, progress=False)
    assert on_device.tobytes() == np.ascontiguousarray(tensors["w"].T).tobytes()
    assert on_host.tobytes() == tensors["h"].astype(np.float32).tobytes()
    assert transfer.sent and transfer.done == len(transfer.pending)


def test_a_load_onto_the_gpu_asks_for_its_sources_ahead(tmp_path, monkeypatch):
    """The device buffers' batches read a cold source ahead too (`aoa.storage.read_ahead`):
    each source range asked for once, before the batch that reads it."""
    from storage.test_read_ahead import Recording, header_ranges

    import aoa.runtime.executor as executor_module

    rng = np.random.default_rng(6)
    tensors = {f"w.{n}": rng.standard_normal((64, 32), dtype=np.float32) for n in range(3)}
    save_folder(tmp_path, tensors)
    transfer = HostTransfer()
    monkeypatch.setattr(buffers, "_device_of", lambda pointer: 0)
    monkeypatch.setattr(cuda, "CupyTransfer", lambda: transfer)
    monkeypatch.setattr(cuda, "DEFAULT_STAGING_BYTES", 8192)  # a batch a slab or two
    monkeypatch.setattr(executor_module, "ReadAhead", Recording)
    Recording.instances = []
    late: list[int] = []
    fill = executor_module.PlanExecutor.fill

    def checked(self, pieces):
        ahead = Recording.instances[-1]
        fill(self, pieces)
        late.extend(offset for (_, offset), mark in ahead.marks.items() if mark > ahead.at
                    and offset in read_by(self, pieces))

    def read_by(executor, pieces):
        rows, _ = executor._table.rows(np.array([p.shard for p in pieces], np.int64))
        sources = executor._table.lowered.table[executor._table.lowered.starts[rows]]
        return {ranges[executor.plan.sources[i].key][0] for i in sources.tolist()}

    ranges = header_ranges(tmp_path / "model.safetensors")
    monkeypatch.setattr(executor_module.PlanExecutor, "fill", checked)
    on_device = {f"v.{n}": np.zeros((32, 64), np.float32) for n in range(3)}
    aoa.load("w.$LAYER_ID^T -> v.$LAYER_ID", source=tmp_path,
             into={k: FakeCudaArray(v) for k, v in on_device.items()}, progress=False)
    (ahead,) = Recording.instances
    assert ahead.closed
    assert sorted(ahead.expected) == sorted((0, *where) for where in ranges.values())
    assert late == []
    for n in range(3):
        assert on_device[f"v.{n}"].tobytes() == np.ascontiguousarray(tensors[f"w.{n}"].T).tobytes()


# -- on a GPU ------------------------------------------------------------------------------------


def _no_gpu() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError: no driver, no device
        return f"CuPy sees no CUDA device ({type(error).__name__})"
    return None if count else "CuPy sees no CUDA device"


NO_GPU = _no_gpu()
if NO_GPU is not None and os.environ.get("AOA_REQUIRE_CUDA"):  # bench/gpu_check.sh sets it
    raise RuntimeError(f"AOA_REQUIRE_CUDA is set, but {NO_GPU}")
gpu = pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("staging_bytes", [96, cuda.DEFAULT_STAGING_BYTES])
def test_gpu_staging_gives_numpys_bytes(program, staging_bytes):
    import cupy

    sources, expected = program
    plan, source_buffer = compile_program(sources, expected)
    outputs = {k: cupy.full(v.shape, 9, v.dtype) for k, v in expected.items()}
    targets = {i: buffers.adapt(outputs[d.key], d.key) for i, d in enumerate(plan.destinations)}
    assert all(isinstance(t, buffers.DeviceBuffer) for t in targets.values())
    cuda.fill_device(plan, targets, source_buffer, staging_bytes=staging_bytes)
    for key, want in expected.items():
        assert cupy.asnumpy(outputs[key]).tobytes() == want.tobytes(), key


@pytest.mark.cuda
@gpu
@pytest.mark.parametrize("pair", sorted(cuda.WIDENINGS))
def test_gpu_widenings_match_numpy(pair):
    import cupy

    narrow, wide = pair
    values = np.array([0.0, -0.0, 1.0, -2.5, 3.0e38, 1.0e-40, 6.0e-8, np.inf, -np.inf, 65504.0],
                      np.float64)
    with np.errstate(over="ignore"):
        host = values.astype(numpy_dtype(narrow))
    source = cupy.asarray(host.view(np.uint8))
    target = cupy.zeros(host.size * itemsize(wide), cupy.uint8)
    transfer = cuda.CupyTransfer()
    stream = transfer.stream()
    transfer.widen(int(source.data.ptr), int(target.data.ptr), pair, host.size, stream)
    transfer.synchronize(stream)
    assert cupy.asnumpy(target).tobytes() == host.astype(numpy_dtype(wide)).tobytes()


@pytest.mark.cuda
@gpu
def test_gpu_load_into_cupy_and_torch(tmp_path):
    import cupy

    from aoa import demo

    hf = demo.make_checkpoint(tmp_path)
    mapping = "\n".join([
        "model.embed_tokens.weight -> embed, dtype='float32'",
        "lm_head.weight^T -> head",
        "model.norm.weight -> norm"])
    embed = cupy.zeros((demo.VOCAB, demo.HIDDEN), cupy.float32)
    into: dict[str, object] = {"embed": embed}
    torch = None
    with contextlib.suppress(ImportError):
        import torch
    if torch is not None and torch.cuda.is_available():
        head = torch.zeros((demo.HIDDEN, demo.VOCAB), dtype=torch.bfloat16, device="cuda")
    else:
        head = np.zeros((demo.HIDDEN, demo.VOCAB), ml_dtypes.bfloat16)
    into["head"] = head
    into["norm"] = np.zeros(demo.HIDDEN, ml_dtypes.bfloat16)
    keep = {k: v for k, v in hf.items() if k in
            ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")}
    mapping += "\n" + "\n".join(f"{k} -> _" for k in hf if k not in keep)
    aoa.load(mapping, source=tmp_path, into=into, progress=False)
    assert cupy.asnumpy(embed).tobytes() == hf["model.embed_tokens.weight"].astype(
        np.float32).tobytes()
    want_head = np.ascontiguousarray(hf["lm_head.weight"].T)
    got_head = (head.view(torch.uint8).cpu().numpy() if torch is not None
                and isinstance(head, torch.Tensor) else head)
    assert np.asarray(got_head).tobytes() == want_head.tobytes()
    assert into["norm"].tobytes() == hf["model.norm.weight"].tobytes()  # type: ignore[attr-defined]
