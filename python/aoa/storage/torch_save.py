"""Files written by ``torch.save``, read and written without torch.

A ``torch.save`` file is an uncompressed zip (`aoa.storage.stored_zip`): ``<name>/data.pkl``
pickles the saved object, each tensor as ``torch._utils._rebuild_tensor_v2(storage,
storage_offset, size, stride, ...)`` (``_rebuild_tensor_v3`` with an explicit dtype for the
dtypes without a legacy storage class: fp8, uint16 ...), and each storage as a persistent id
``("storage", storage class, key, location, size)`` whose bytes are the record
``<name>/data/<key>``. Reading runs the pickle through the restricted machine
(`aoa.storage.unpickler`): tensors become `SavedTensor` records pointing into the file, which
honour storage offsets and strides (tied weights share one storage; a transposed tensor has
strides of its own). Writing lays out a file of whole C-order tensors whose bytes the kernel
fills in place (`TorchSaveLayout`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from aoa.dtypes import ITEMSIZES, itemsize
from aoa.errors import StorageError
from aoa.storage import pickler, unpickler
from aoa.storage.mapped import MappedFile, Stored
from aoa.storage.stored_zip import StoredRecord, ZipLayout, read_records

#: torch's legacy storage classes, by the dtype (Paddle name) of their elements.
STORAGE_CLASSES = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
    "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage",
}
_STORAGE_DTYPES = {name: dtype for dtype, name in STORAGE_CLASSES.items()}
#: torch dtype names that aoa reads (``torch.<name>``), by their Paddle names.
TORCH_DTYPES = {dtype: dtype for dtype in ITEMSIZES}
_REBUILD = "torch._utils._rebuild_tensor_v2"
_REBUILD_V3 = "torch._utils._rebuild_tensor_v3"
_PARAMETER = "torch._utils._rebuild_parameter"
_PARAMETER_STATE = "torch._utils._rebuild_parameter_with_state"
_UNTYPED = "torch.storage.UntypedStorage"


class StateDict(dict):
    """``collections.OrderedDict`` as a pickle builds it; a module's ``state_dict()`` also
    carries ``_metadata`` (module versions), kept here as ``state`` and not used."""

    state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


ALLOWED: unpickler.Allowed = {
    ("collections", "OrderedDict"): StateDict,
    **unpickler.records(_REBUILD, _REBUILD_V3, _PARAMETER, _PARAMETER_STATE, _UNTYPED,
                        *(f"torch.{name}" for name in STORAGE_CLASSES.values()),
                        *(f"torch.{name}" for name in TORCH_DTYPES)),
}


@dataclass(frozen=True)
class SavedStorage:
    """A storage of the file: its key, its element dtype and its bytes' range in the file."""

    key: str
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SavedTensor:
    """A tensor of the file: a view (offset and strides in elements) of one storage."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage: SavedStorage

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def contiguous_offset(self) -> int | None:
        """Where the tensor's bytes start in the file if they lie there in C order, else
        None (a transposed or strided view, gathered by `gather`)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return None
            expected *= size
        return self.storage.offset + self.storage_offset * itemsize(self.dtype)

    def gather(self, data: memoryview) -> np.ndarray:
        """The tensor's elements in C order, copied out of its storage's bytes in ``data``."""
        storage = np.frombuffer(data[self.storage.offset:self.storage.offset
                                     + self.storage.nbytes], dtype=np.uint8)
        size = itemsize(self.dtype)
        view = np.lib.stride_tricks.as_strided(
            storage[self.storage_offset * size:], shape=(*self.shape, size),
            strides=(*(s * size for s in self.stride), 1), writeable=False)
        return np.ascontiguousarray(view)


def stored(tensor: SavedTensor, file: MappedFile) -> Stored:
    """Where ``tensor``'s bytes lie in ``file``: in place when C-contiguous, else the range
    of its storage, gathered into C order when read."""
    start = tensor.contiguous_offset()
    if start is None:
        return Stored(file, tensor.storage.offset, tensor.storage.nbytes,
                      lambda _view: tensor.gather(file.data))
    return Stored(file, start, tensor.nbytes)


def read_torch_save(data: memoryview, where: str | Path, start: int = 0,
                    end: int | None = None) -> Any:
    """The object a ``torch.save`` file (or an archive at ``data[start:end]``) holds, its
    tensors as `SavedTensor` records with offsets into ``data``."""
    records = read_records(data, where, start, end)
    name = _pickle_name(records, where)
    prefix = name[:-len("data.pkl")]
    storages: dict[str, SavedStorage] = {}

    def persistent_load(pid: Any) -> SavedStorage:
        return _storage(pid, records, prefix, storages, where)

    pickle = records[name]
    loaded = unpickler.load(data, where, ALLOWED, start=pickle.offset,
                            end=pickle.offset + pickle.nbytes, persistent_load=persistent_load)
    return saved_tensors(loaded, where)


def check_torch_save(data: memoryview, where: str | Path, start: int = 0,
                     end: int | None = None) -> None:
    """That ``data[start:end]`` is a ``torch.save`` archive (its records within it, one
    pickle), without unpickling it: for objects carried as the bytes they are."""
    _pickle_name(read_records(data, where, start, end), where)


def _pickle_name(records: dict[str, StoredRecord], where: str | Path) -> str:
    pickles = [name for name in records if name.endswith("data.pkl")
               and name.count("/") == 1]
    if len(pickles) != 1:
        raise StorageError(f"{where}: not a torch.save file: {len(pickles)} 'data.pkl' records "
                           "where there should be one")
    return pickles[0]


def _storage(pid: Any, records: dict[str, StoredRecord], prefix: str,
             storages: dict[str, SavedStorage], where: str | Path) -> SavedStorage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
            and isinstance(pid[1], unpickler.RecordClass) and isinstance(pid[2], str)
            and isinstance(pid[4], int)):
        raise StorageError(f"{where}: persistent id {pid!r} is not a torch storage")
    _, cls, key, location, numel = pid
    dtype = storage_dtype(cls, key, location, where)
    record = records.get(f"{prefix}data/{key}")
    if record is None:
        raise StorageError(f"{where}: storage '{key}' has no record '{prefix}data/{key}'")
    if record.nbytes != numel * itemsize(dtype):
        raise StorageError(f"{where}: storage '{key}' holds {record.nbytes} bytes, but its "
                           f"{numel} {dtype} elements need {numel * itemsize(dtype)}")
    found = storages.get(key)
    if found is None:
        found = storages[key] = SavedStorage(key, dtype, record.offset, record.nbytes)
    return found


def storage_dtype(cls: unpickler.RecordClass, key: str, location: Any, where: str | Path
                  ) -> str:
    """The element dtype of a storage of class ``cls`` (a persistent id's), checked with its
    device ``location``."""
    if cls.qualname == _UNTYPED:
        dtype = "uint8"
    elif cls.module == "torch" and cls.name in _STORAGE_DTYPES:
        dtype = _STORAGE_DTYPES[cls.name]
    else:
        raise StorageError(f"{where}: storage '{key}' is a {cls.qualname}, which aoa does not "
                           "read")
    if not str(location).startswith(("cpu", "cuda", "meta", "npu", "xpu", "mps")):
        raise StorageError(f"{where}: storage '{key}' is on device '{location}'")
    return dtype


def saved_tensors(value: Any, where: str | Path) -> Any:
    """``value``, an unpickled object whose storages are `SavedStorage` records, with every
    tensor record replaced by its `SavedTensor`, checked."""
    try:
        return _tensors(value, where)
    except RecursionError:
        raise StorageError(f"{where}: the saved object is nested too deeply") from None


def _tensors(value: Any, where: str | Path) -> Any:
    """``value`` with every tensor record replaced by its `SavedTensor`, checked."""
    if isinstance(value, unpickler.Record):
        name = value.cls.qualname
        if name in (_PARAMETER, _PARAMETER_STATE) and value.args:
            return _tensors(value.args[0], where)
        if name in (_REBUILD, _REBUILD_V3):
            return _tensor(value, where)
        raise StorageError(f"{where}: holds a {name}, which is not a tensor")
    if isinstance(value, dict):
        rebuilt = {key: _tensors(item, where) for key, item in value.items()}
        if isinstance(value, StateDict):
            state_dict = StateDict(rebuilt)
            state_dict.state = value.state
            return state_dict
        return rebuilt
    if isinstance(value, (list, tuple)):
        return type(value)(_tensors(item, where) for item in value)
    return value


def _tensor(record: unpickler.Record, where: str | Path) -> SavedTensor:
    args = record.args
    v3 = record.cls.qualname == _REBUILD_V3
    if len(args) < (7 if v3 else 6):
        raise StorageError(f"{where}: a tensor is rebuilt from {len(args)} arguments")
    storage, storage_offset, size, stride = args[:4]
    if not isinstance(storage, SavedStorage):
        raise StorageError(f"{where}: a tensor's storage is {type(storage).__name__}")
    shape = unpickler.int_tuple(size, where, "a tensor's size")
    strides = unpickler.int_tuple(stride, where, "a tensor's stride", size=len(shape))
    offset = unpickler.int_tuple((storage_offset,), where, "a tensor's storage offset")[0]
    dtype = storage.dtype
    if v3:
        cls = args[6]
        if not (isinstance(cls, unpickler.RecordClass) and cls.module == "torch"
                and cls.name in TORCH_DTYPES):
            raise StorageError(f"{where}: a tensor has dtype {cls!r}, which aoa does not read")
        dtype = TORCH_DTYPES[cls.name]
    metadata = args[7 if v3 else 6] if len(args) > (7 if v3 else 6) else None
    if metadata:
        raise StorageError(f"{where}: a tensor carries lazy conjugate or negative bits "
                           f"{metadata!r}; save it resolved (tensor.resolve_conj())")
    tensor = SavedTensor(dtype, shape, strides, offset, storage)
    size_of = itemsize(dtype)
    if math.prod(shape):
        last = offset + sum((n - 1) * s for n, s in zip(shape, strides))
        if (last + 1) * size_of > storage.nbytes:
            raise StorageError(
                f"{where}: a {dtype} tensor of shape {list(shape)} at storage offset {offset} "
                f"with strides {list(strides)} reaches past the end of storage '{storage.key}' "
                f"({storage.nbytes} bytes)")
    return tensor


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class TensorToSave:
    """A whole C-order tensor of a file being written."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


class TorchSaveLayout:
    """A ``torch.save`` archive of ``tensors`` (each its own storage) laid out before any
    byte is written: ``data_offset(i)`` says where tensor ``i``'s bytes go; ``write`` writes
    everything else once they are filled. ``value`` arranges the tensors (default: the one
    tensor itself; any tree of dicts, lists and tuples whose int leaves are indices).

    ``base`` is where the archive starts in its file, so that tensor bytes are aligned there.
    """

    def __init__(self, tensors: Sequence[TensorToSave], value: Any = 0, *,
                 archive: str = "archive", base: int = 0) -> None:
        self.tensors = list(tensors)
        self.pickle = pickler.dumps(_saved_value(value, self.tensors), protocol=2).bytes()
        small = {
            ".format_version": b"1", ".storage_alignment": b"64", "byteorder": b"little",
        }
        self.small = {f"{archive}/data.pkl": self.pickle,
                      **{f"{archive}/{name}": data for name, data in small.items()}}
        records = [(name, len(data)) for name, data in self.small.items()]
        records += [(f"{archive}/data/{i}", t.nbytes) for i, t in enumerate(self.tensors)]
        self.small[f"{archive}/version"] = b"3\n"
        records.append((f"{archive}/version", 2))
        self.zip = ZipLayout(records, base=base)
        self.archive = archive
        self.nbytes = self.zip.nbytes

    def data_offset(self, index: int) -> int:
        """Where tensor ``index``'s bytes start, from the archive's first byte."""
        return self.zip.record(f"{self.archive}/data/{index}").offset

    def write(self, out: memoryview) -> None:
        """Write all but the tensor bytes (already filled) into ``out``, the archive's bytes."""
        for name, data in self.small.items():
            record = self.zip.record(name)
            out[record.offset:record.offset + record.nbytes] = data
        self.zip.write(out)


def _saved_value(value: Any, tensors: Sequence[TensorToSave]) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return _rebuild(value, tensors[value])
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, dict):
        return {key: _saved_value(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_saved_value(item, tensors) for item in value)
    raise TypeError(f"cannot save {type(value).__name__}")


def _rebuild(index: int, tensor: TensorToSave) -> pickler.Call:
    """``_rebuild_tensor_v2`` of a C-order tensor filling storage ``index``, as torch.save
    writes it (``_v3`` with an untyped storage for dtypes without a legacy storage class)."""
    stride = tuple(math.prod(tensor.shape[axis + 1:]) for axis in range(len(tensor.shape)))
    hooks = pickler.Call(pickler.Global("collections", "OrderedDict"), ())
    legacy = STORAGE_CLASSES.get(tensor.dtype)
    if legacy is not None:
        pid = ("storage", pickler.Global("torch", legacy), str(index), "cpu",
               math.prod(tensor.shape))
        args: tuple = (pickler.PersistentId(pid), 0, tensor.shape, stride, False, hooks)
        return pickler.Call(pickler.Global("torch._utils", "_rebuild_tensor_v2"), args)
    pid = ("storage", pickler.Global("torch.storage", "UntypedStorage"), str(index), "cpu",
           tensor.nbytes)
    args = (pickler.PersistentId(pid), 0, tensor.shape, stride, False, hooks,
            pickler.Global("torch", tensor.dtype))
    return pickler.Call(pickler.Global("torch._utils", "_rebuild_tensor_v3"), args)
