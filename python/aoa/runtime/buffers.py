"""The caller's buffers as the executor sees them: bytes on the host, or a pointer on a GPU.

`adapt` takes a numpy array, a PyTorch tensor, a CuPy array, or anything that speaks the
buffer protocol, DLPack or ``__cuda_array_interface__``, and returns its shape, its dtype by
Paddle's name (torch.bfloat16 -> "bfloat16") and where its bytes are: a `HostBuffer` the
kernel writes in place, or a `DeviceBuffer` that CUDA staging fills. No framework is
imported unless the buffer is one of its own: a torch tensor cannot exist without torch
having been imported already, so `sys.modules` says whether to look.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

from aoa.dtypes import NUMPY_DTYPES, itemsize
from aoa.errors import UsageError
from aoa.runtime.copies import c_strides

_NAME_OF_NUMPY: dict[np.dtype, str] = {dtype: name for name, dtype in NUMPY_DTYPES.items()}


#: Where a caller's buffer lies: device ("cpu", or "cuda:N"), address, strides in bytes.
#: Two buffers of one shape and dtype at one place are the same memory, as the tensors of
#: tied weights are (an embedding and the head that shares it).
Place = tuple[str, int, tuple[int, ...]]


@dataclass
class HostBuffer:
    """A destination in host memory. ``data`` is a writable, C-contiguous byte buffer of
    ``shape`` and ``dtype`` for the kernel; ``finish``, when set, moves the bytes from
    ``data`` into the caller's buffer (a strided one, which the kernel cannot fill)."""

    shape: tuple[int, ...]
    dtype: str
    data: np.ndarray
    kind: str
    finish: Callable[[], None] | None = None
    #: the object whose memory ``data`` views, held while the copies run
    owner: object = None
    #: where the caller's buffer lies (`Place`)
    place: Place | None = None

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * itemsize(self.dtype)


@dataclass
class DeviceBuffer:
    """A C-contiguous destination in the memory of CUDA device ``device``, at ``pointer``;
    ``owner`` is the caller's object, held so the memory outlives the copies."""

    shape: tuple[int, ...]
    dtype: str
    pointer: int
    device: int
    kind: str
    owner: object
    #: where the caller's buffer lies (`Place`)
    place: Place | None = None

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * itemsize(self.dtype)


Adapted = HostBuffer | DeviceBuffer


def adapt(buffer: object, what: str) -> Adapted:
    """Where ``buffer``'s bytes are, its shape and dtype; ``what`` names it in errors
    (e.g. "the buffer for 'lm_head.weight'")."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buffer, torch.Tensor):
        return _from_torch(buffer, what)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(buffer, cupy.ndarray):
        return _from_cupy(buffer, what)
    if isinstance(buffer, np.ndarray):
        return _from_numpy(buffer, what)
    if hasattr(buffer, "__cuda_array_interface__"):
        return _from_cuda_array_interface(buffer, what)
    if hasattr(buffer, "__dlpack__") and hasattr(buffer, "__dlpack_device__"):
        return _from_dlpack(buffer, what)
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError:
        raise UsageError(
            f"{what} is a {type(buffer).__name__}, which aoa cannot fill",
            hint="Give a numpy array, a torch tensor, a CuPy array, or an object with the "
                 "buffer protocol, DLPack or __cuda_array_interface__.") from None
    if view.readonly:
        raise UsageError(f"{what} is read-only ({type(buffer).__name__})")
    try:
        array = np.asarray(view)
    except (TypeError, ValueError) as error:
        raise UsageError(f"{what} has item format {view.format!r}, which aoa does not know: "
                         f"{error}") from None
    return _from_numpy(array, what, kind=type(buffer).__name__)


# -- host ----------------------------------------------------------------------------------


def _from_numpy(array: np.ndarray, what: str, kind: str = "numpy array") -> HostBuffer:
    dtype = _NAME_OF_NUMPY.get(array.dtype)
    if dtype is None:
        raise UsageError(f"{what} has dtype {array.dtype}, which aoa does not know",
                         hint=f"Use one of: {', '.join(NUMPY_DTYPES)} (in native byte order).")
    if not array.flags.writeable:
        raise UsageError(f"{what} is read-only ({kind})")
    shape = tuple(array.shape)
    place = ("cpu", array.__array_interface__["data"][0], tuple(array.strides))
    if array.flags.c_contiguous:
        return HostBuffer(shape, dtype, array, kind, place=place)
    staged = np.empty(shape, array.dtype)  # filled by the kernel, then copied over

    def finish() -> None:
        array[...] = staged

    return HostBuffer(shape, dtype, staged, kind, finish, place=place)


def _torch_dtype(tensor, what: str) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in NUMPY_DTYPES:
        raise UsageError(f"{what} has dtype {tensor.dtype}, which aoa does not know",
                         hint=f"Use one of: {', '.join(NUMPY_DTYPES)}.")
    return name


def _from_torch(tensor, what: str) -> Adapted:
    dtype = _torch_dtype(tensor, what)
    shape = tuple(tensor.shape)
    strides = tuple(n * tensor.element_size() for n in tensor.stride())
    if tensor.device.type == "cuda":
        if not tensor.is_contiguous():
            raise UsageError(f"{what} is a strided CUDA tensor; aoa fills contiguous ones",
                             hint="Load into a contiguous tensor, then copy it over.")
        device = tensor.device.index or 0
        return DeviceBuffer(shape, dtype, tensor.data_ptr(), device, "torch tensor", tensor,
                            (f"cuda:{device}", tensor.data_ptr(), strides))
    if tensor.device.type != "cpu":
        raise UsageError(f"{what} is on device {tensor.device}; aoa fills CPU and CUDA tensors")
    place = ("cpu", tensor.data_ptr(), strides)
    if tensor.is_contiguous():
        return HostBuffer(shape, dtype, _bytes_at(tensor.data_ptr(), tensor.nbytes),
                          "torch tensor", owner=tensor, place=place)
    staged = tensor.new_empty(shape)  # contiguous; copied over when the kernel is done

    def finish() -> None:
        with sys.modules["torch"].no_grad():
            tensor.copy_(staged)

    return HostBuffer(shape, dtype, _bytes_at(staged.data_ptr(), staged.nbytes),
                      "torch tensor", finish, owner=staged, place=place)


def _bytes_at(pointer: int, nbytes: int) -> np.ndarray:
    """``nbytes`` host bytes at ``pointer`` as a writable uint8 array (the memory's owner
    must be held elsewhere while it is used)."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(pointer))


# -- device --------------------------------------------------------------------------------


def _from_cupy(array, what: str) -> DeviceBuffer:
    dtype = _NAME_OF_NUMPY.get(np.dtype(array.dtype))
    if dtype is None:
        raise UsageError(f"{what} has dtype {array.dtype}, which aoa does not know")
    if not array.flags.c_contiguous:
        raise UsageError(f"{what} is a strided CuPy array; aoa fills contiguous ones",
                         hint="Load into a contiguous array, then copy it over.")
    device = int(array.device.id)
    return DeviceBuffer(tuple(array.shape), dtype, int(array.data.ptr), device, "CuPy array",
                        array, (f"cuda:{device}", int(array.data.ptr), tuple(array.strides)))


def _from_cuda_array_interface(buffer, what: str) -> DeviceBuffer:
    interface = buffer.__cuda_array_interface__
    shape = tuple(interface["shape"])
    try:
        numpy_dtype = np.dtype(interface["typestr"])
    except TypeError:
        numpy_dtype = None
    dtype = _NAME_OF_NUMPY.get(numpy_dtype) if numpy_dtype is not None else None
    if dtype is None:
        raise UsageError(f"{what} has type {interface['typestr']!r}, which aoa does not know")
    pointer, readonly = interface["data"]
    if readonly:
        raise UsageError(f"{what} is read-only (__cuda_array_interface__)")
    strides = interface.get("strides")
    if strides is not None and tuple(strides) != c_strides(shape, numpy_dtype.itemsize):
        raise UsageError(f"{what} is strided (__cuda_array_interface__); aoa fills "
                         "contiguous buffers")
    device = _device_of(int(pointer))
    return DeviceBuffer(shape, dtype, int(pointer), device, type(buffer).__name__, buffer,
                        (f"cuda:{device}", int(pointer),
                         c_strides(shape, numpy_dtype.itemsize)))


def _from_dlpack(buffer, what: str) -> Adapted:
    device_type, _ = buffer.__dlpack_device__()
    if device_type == 1:  # kDLCPU
        try:
            array = np.from_dlpack(buffer)
        except (BufferError, TypeError, RuntimeError) as error:
            raise UsageError(f"{what}: numpy cannot take it by DLPack: {error}") from None
        return _from_numpy(array, what, kind=f"{type(buffer).__name__} (DLPack)")
    if device_type == 2:  # kDLCUDA
        import cupy

        return _from_cupy(cupy.from_dlpack(buffer), what)
    raise UsageError(f"{what} is on DLPack device type {device_type}; aoa fills CPU and "
                     "CUDA buffers")


def _device_of(pointer: int) -> int:
    import cupy

    return int(cupy.cuda.runtime.pointerGetAttributes(pointer).device)


# -- memory shared between buffers ---------------------------------------------------------


def overlapping(buffers: Sequence[Adapted], labels: Sequence[object]) -> tuple[int, int] | None:
    """The positions of two of ``buffers`` that share an element of memory, if any: the
    kernel's threads would write both, and one key would be left with the other's bytes.
    Buffers at one place, of one shape and dtype, with equal ``labels``, are the same
    destination given twice and filled alike. Byte ranges are compared first, in one sweep;
    where two meet and either is strided (`w[:, ::2]` beside `w[:, 1::2]` share none), numpy
    tells exactly (`np.shares_memory`)."""
    spans = sorted(span for position, buffer in enumerate(buffers)
                   if (span := _span(buffer, position)) is not None)
    begun: list[_Span] = []  # the spans begun so far that may reach the next one
    device, reach = None, 0
    for span in spans:
        if span[0] != device or span[1] >= reach:  # (apart from all before it)
            device, reach, begun = span[0], span[2], [span]
            continue
        begun = [other for other in begun if other[2] > span[1]]
        for other in begun:
            one, two = buffers[other[3]], buffers[span[3]]
            if (one.place, one.shape, one.dtype, labels[other[3]]) == (
                    two.place, two.shape, two.dtype, labels[span[3]]):
                continue
            if _share_memory((other, one), (span, two)):
                return min(other[3], span[3]), max(other[3], span[3])
        begun.append(span)
        reach = max(reach, span[2])
    return None


#: The bytes a buffer reaches: device, [start, end), the buffer's position.
_Span = tuple[str, int, int, int]


def _span(buffer: Adapted, position: int) -> _Span | None:
    if buffer.place is None or not prod(buffer.shape):
        return None  # (no place known, or no element)
    device, address, strides = buffer.place
    start = end = address
    for size, stride in zip(buffer.shape, strides):
        if stride < 0:
            start += (size - 1) * stride
        else:
            end += (size - 1) * stride
    return device, start, end + itemsize(buffer.dtype), position


def _share_memory(*given: tuple[_Span, Adapted]) -> bool:
    """Whether two buffers whose spans meet share a byte. Their memory is described to numpy
    by address and never read: it may be a GPU's."""
    places = [buffer.place for _, buffer in given]
    if all(place is not None and place[2] == c_strides(buffer.shape, itemsize(buffer.dtype))
           for place, (_, buffer) in zip(places, given)):
        return True
    start, end = min(span[1] for span, _ in given), max(span[2] for span, _ in given)
    memory = np.ctypeslib.as_array((ctypes.c_uint8 * (end - start)).from_address(start))
    first, second = (np.lib.stride_tricks.as_strided(
        memory[place[1] - start:], (*buffer.shape, itemsize(buffer.dtype)), (*place[2], 1))
        for place, (_, buffer) in zip(places, given) if place is not None)
    return bool(np.shares_memory(first, second))
