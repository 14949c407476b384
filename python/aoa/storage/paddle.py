"""The ``paddle`` format: PaddlePaddle FlexCheckpoint, as ``paddle.distributed.save_state_dict``
writes it, read and written without Paddle.

A checkpoint saved with unique id ``n`` is a folder of:

* ``{n}.metadata``: a pickle of ``Metadata``: ``state_dict_metadata`` lists, per key, every
  stored box (``LocalTensorMetadata``: global offset, local shape, dtype, global shape, and
  for a flattened shard the range of the box's C-order elements it holds);
  ``storage_metadata`` maps each box (``LocalTensorIndex``) to the file holding it;
  ``flat_mapping`` maps keys to their paths in a nested state dict.
* ``{rank}_{n}.distcp``: ``paddle.save`` of the rank's dict ``key -> numpy array`` (plus a
  name table), a pickle with each array's bytes inside it. The dtype comes from the metadata
  (bfloat16 is stored as ``uint16``, fp8 as ``int8``), only the element size from the array.

Flattened shards (``is_flattened``, ``flattened_range``: a sharded optimizer's slice of the
flattened parameter) are read as the boxes their element range covers, each contiguous in
the file. Several ``*.metadata`` files in one folder (saves with different unique ids) are
an error unless one is chosen by giving its path.

Writing: one ``{rank}_0.distcp`` per rank, each array's bytes laid out in the pickle (aligned
to 64 bytes) and filled in place by the kernel, then ``0.metadata``. A box held by several
ranks is written once, as Paddle does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from aoa.dtypes import ITEMSIZES, itemsize
from aoa.errors import StorageError
from aoa.layout import ShardDesc, shards_nbytes
from aoa.storage import numpy_pickle, pickler, unpickler
from aoa.storage.chunks import Chunk, key_shards
from aoa.storage.formats import Destination, FileLayout, Format, OutputFile, ShardSpan
from aoa.storage.mapped import MappedFiles, MappedSource, Stored

_META = "paddle.distributed.flex_checkpoint.dcp.metadata"
#: ``paddle.save``'s table of tensor names, beside the tensors in every ``.distcp`` file.
NAME_TABLE = "StructuredToParameterName@@"
_METADATA_NAME = re.compile(r"^(\d+)\.metadata$")
_DATA_NAME = re.compile(r"^(\d+)_(\d+)\.distcp$")


def _paddle_eval(name: str, namespace: dict) -> Any:
    """``eval("data", {"data": array})``, how old ``paddle.save`` pickles a DenseTensor:
    read as the lookup it is, never evaluated."""
    if not isinstance(name, str) or not isinstance(namespace, dict) or name not in namespace:
        raise ValueError("eval is read only as paddle.save writes a DenseTensor")
    return namespace[name]


ALLOWED: unpickler.Allowed = {
    **unpickler.records(f"{_META}.Metadata", f"{_META}.LocalTensorMetadata",
                        f"{_META}.LocalTensorIndex"),
    **numpy_pickle.ALLOWED,
    ("builtins", "tuple"): tuple,  # paddle.save of an eager Tensor: (name, array)
    ("builtins", "eval"): _paddle_eval,
}


# ------------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class LocalTensor:
    """A stored box of a key, as ``LocalTensorMetadata`` describes it."""

    key: str
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    global_shape: tuple[int, ...] | None
    flattened_range: tuple[int, int] | None


@dataclass(frozen=True)
class StoredTensor:
    """Which file holds a box (``LocalTensorIndex`` and its file name)."""

    key: str
    global_offset: tuple[int, ...]
    flattened_range: tuple[int, int] | None
    replica_id: int | None
    file: str
    local_shape: tuple[int, ...] | None  # Paddle 3.x says it; older checkpoints do not


@dataclass(frozen=True)
class PaddleMetadata:
    tensors: dict[str, list[LocalTensor]]
    storage: list[StoredTensor]
    flat_mapping: dict[str, Any]


def read_metadata(data: memoryview, where: Path) -> PaddleMetadata:
    """The metadata pickle at ``where``, every field checked."""
    value = unpickler.load_metadata(data, where, ALLOWED)
    fields = unpickler.fields(value, f"{_META}.Metadata", where, "the metadata")
    state = fields.get("state_dict_metadata")
    storage = fields.get("storage_metadata")
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise StorageError(f"{where}: the metadata has no state_dict_metadata and "
                           "storage_metadata dicts")
    tensors: dict[str, list[LocalTensor]] = {}
    for key, boxes in state.items():
        key = unpickler.string(key, where, "a key of state_dict_metadata")
        if not isinstance(boxes, list):
            boxes = [boxes]
        tensors[key] = [_local_tensor(key, box, where) for box in boxes]
    stored = [_stored_tensor(index, file, where) for index, file in storage.items()]
    flat_mapping = fields.get("flat_mapping") or {}
    return PaddleMetadata(tensors, stored, flat_mapping if isinstance(flat_mapping, dict) else {})


def _local_tensor(key: str, value: Any, where: Path) -> LocalTensor:
    what = f"LocalTensorMetadata of '{key}'"
    fields = unpickler.fields(value, f"{_META}.LocalTensorMetadata", where, what)
    local_shape = unpickler.int_tuple(fields.get("local_shape"), where, f"{what}: local_shape")
    offset = unpickler.int_tuple(fields.get("global_offset"), where, f"{what}: global_offset",
                                 size=len(local_shape))
    dtype = unpickler.string(fields.get("dtype"), where, f"{what}: dtype")
    if dtype not in ITEMSIZES:
        raise StorageError(f"{where}: {what} has dtype '{dtype}', which aoa does not read")
    global_shape = fields.get("global_shape")
    if global_shape is not None:
        global_shape = unpickler.int_tuple(global_shape, where, f"{what}: global_shape",
                                           size=len(local_shape))
    return LocalTensor(key, offset, local_shape, dtype, global_shape,
                       _flattened(fields, local_shape, where, what))


def _flattened(fields: dict, local_shape: tuple[int, ...], where: Path,
               what: str) -> tuple[int, int] | None:
    if not fields.get("is_flattened"):
        return None
    found = unpickler.int_tuple(fields.get("flattened_range"), where,
                                f"{what}: flattened_range", size=2)
    start, stop = found
    if not start <= stop <= math.prod(local_shape):
        raise StorageError(f"{where}: {what}: flattened_range {list(found)} is not a range of "
                           f"the {math.prod(local_shape)} elements of {list(local_shape)}")
    return start, stop


def _stored_tensor(index: Any, file: Any, where: Path) -> StoredTensor:
    fields = unpickler.fields(index, f"{_META}.LocalTensorIndex", where,
                              "a key of storage_metadata")
    key = unpickler.string(fields.get("tensor_key"), where, "LocalTensorIndex.tensor_key")
    what = f"LocalTensorIndex of '{key}'"
    offset = unpickler.int_tuple(fields.get("global_offset"), where, f"{what}: global_offset")
    flattened = None
    if fields.get("is_flattened"):
        flattened = unpickler.int_tuple(fields.get("flattened_range"), where,
                                        f"{what}: flattened_range", size=2)
    replica = fields.get("replica_id")
    local_shape = fields.get("local_shape")
    if local_shape is not None:
        local_shape = unpickler.int_tuple(local_shape, where, f"{what}: local_shape")
    name = unpickler.string(file, where, f"the file of '{key}'")
    if Path(name).name != name or not name:
        raise StorageError(f"{where}: file name '{name}' of '{key}' is not a name inside "
                           "the folder")
    return StoredTensor(key, offset, flattened,  # type: ignore[arg-type]
                        replica if isinstance(replica, int) else None, name, local_shape)


def metadata_value(boxes: Sequence[tuple[ShardDesc, str]]) -> pickler.Build:
    """The pickle of ``Metadata`` for these (box, file name) pairs, as Paddle writes it."""
    tensors: dict[str, list[pickler.Build]] = {}
    storage: list[tuple[Any, str]] = []
    for shard, file in boxes:
        tensors.setdefault(shard.key, []).append(pickler.Build(
            pickler.New(pickler.Global(_META, "LocalTensorMetadata")), {
                "global_offset": shard.global_offset, "local_shape": shard.local_shape,
                "dtype": shard.dtype, "global_shape": shard.global_shape,
                "is_flattened": False, "flattened_range": None}))
        storage.append((pickler.Build(
            pickler.New(pickler.Global(_META, "LocalTensorIndex")), {
                "tensor_key": shard.key, "global_offset": shard.global_offset,
                "is_flattened": False, "flattened_range": None, "replica_id": None,
                "local_shape": shard.local_shape}), file))
    return pickler.Build(pickler.New(pickler.Global(_META, "Metadata")), {
        "state_dict_metadata": tensors,
        "storage_metadata": pickler.Pairs(tuple(storage)),
        "flat_mapping": {key: (key,) for key in tensors},
    })


# -------------------------------------------------------------------------------- reading


class PaddleSource(MappedSource):
    """An open Paddle checkpoint: its metadata and the mapped ``.distcp`` files."""

    def __init__(self, path: Path, metadata: Path, files: MappedFiles,
                 stored: dict[str, list[tuple[ShardDesc, Stored]]]) -> None:
        super().__init__(path, "paddle", stored)
        self.metadata = metadata
        self._files = files

    def files(self) -> list[Path]:
        return sorted([self.metadata, *self._files.files])


def claims(path: Path) -> bool:
    """A Paddle ``{n}.metadata`` file, or a folder holding one."""
    if path.is_file():
        return _METADATA_NAME.match(path.name) is not None
    return path.is_dir() and bool(_metadata_files(path))


def _metadata_files(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if _METADATA_NAME.match(p.name) and p.is_file()),
                  key=lambda p: int(p.name.split(".")[0]))


def choose_metadata(path: Path) -> Path:
    """The metadata file to read: ``path`` itself, or the one ``*.metadata`` of the folder."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise StorageError(f"{path}: no such checkpoint file or folder")
    found = _metadata_files(path)
    if not found:
        raise StorageError(f"{path}: no Paddle metadata file ({{n}}.metadata) in this folder")
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise StorageError(f"{path}: holds {len(found)} metadata files ({names}), one per save",
                           hint=f"Give the one to read, e.g. {found[-1]}.")
    return found[0]


def open_paddle(path: Path) -> PaddleSource:
    """Open the checkpoint whose metadata is ``path`` (or the folder holding just one)."""
    metadata_path = choose_metadata(path)
    files = MappedFiles()
    try:
        metadata = read_metadata(files.open(metadata_path).data, metadata_path)
        files.close()  # the metadata is read; only data files stay mapped
        stored = _stored_shards(metadata, metadata_path, files)
        return PaddleSource(path, metadata_path, files, stored)
    except BaseException:
        files.close()
        raise


def _stored_shards(metadata: PaddleMetadata, where: Path,
                   files: MappedFiles) -> dict[str, list[tuple[ShardDesc, Stored]]]:
    _check_global_shapes(metadata, where)
    boxes = {(box.key, box.global_offset, box.flattened_range): box
             for boxes in metadata.tensors.values() for box in boxes}
    contents: dict[str, dict[str, Any]] = {}
    chunks: dict[str, list[Chunk]] = {key: [] for key in metadata.tensors}
    # (file, key) -> the box it holds: a file holds one array per key
    held: dict[tuple[str, str], LocalTensor] = {}
    for stored in metadata.storage:
        box = boxes.get((stored.key, stored.global_offset, stored.flattened_range))
        if box is None:
            raise StorageError(f"{where}: storage_metadata names a box of '{stored.key}' at "
                               f"{list(stored.global_offset)} that state_dict_metadata does "
                               "not describe")
        if stored.local_shape is not None and stored.local_shape != box.local_shape:
            raise StorageError(f"{where}: storage_metadata's box of '{stored.key}' at "
                               f"{list(stored.global_offset)} has shape "
                               f"{list(stored.local_shape)}, but state_dict_metadata's has "
                               f"{list(box.local_shape)}")
        other = held.setdefault((stored.file, stored.key), box)
        if other != box:
            raise StorageError(f"{where}: '{stored.file}' holds one array of '{stored.key}', "
                               f"but storage_metadata stores two boxes of it there (at "
                               f"{list(other.global_offset)} and {list(box.global_offset)})")
        path = where.parent / stored.file
        if not path.is_file():
            raise StorageError(f"{where}: names data file '{stored.file}' (for "
                               f"'{stored.key}'), which does not exist")
        if stored.file not in contents:
            mapped = files.open(path)
            contents[stored.file] = _file_tensors(mapped.data, path)
        chunks[stored.key] += _box_chunks(box, contents[stored.file], files.open(path).path,
                                          files)
    result: dict[str, list[tuple[ShardDesc, Stored]]] = {}
    for key, found in chunks.items():
        if not found:
            raise StorageError(f"{where}: tensor '{key}' is described but no data file "
                               "holds it")
        global_shape = metadata.tensors[key][0].global_shape
        result[key] = cast(list[tuple[ShardDesc, Stored]],
                           key_shards(key, found, global_shape))
    return result


def _check_global_shapes(metadata: PaddleMetadata, where: Path) -> None:
    """The boxes of a key say one global shape (the first one's is the tensor's)."""
    for key, boxes in metadata.tensors.items():
        shapes = {box.global_shape for box in boxes if box.global_shape is not None}
        if len(shapes) > 1:
            first, second = sorted(shapes)[:2]
            raise StorageError(f"{where}: state_dict_metadata's boxes of '{key}' disagree on "
                               f"its global shape: {list(first)} and {list(second)}")


def _file_tensors(data: memoryview, path: Path) -> dict[str, Any]:
    value = unpickler.load(data, path, ALLOWED)
    if not isinstance(value, dict):
        raise StorageError(f"{path}: holds a {type(value).__name__}, not paddle.save's dict "
                           "of tensors")
    value.pop(NAME_TABLE, None)
    return value


def _box_chunks(box: LocalTensor, tensors: dict[str, Any], path: Path,
                files: MappedFiles) -> list[Chunk]:
    """The chunks of ``box``, found in a data file's tensors."""
    what = f"tensor '{box.key}'"
    value = tensors.get(box.key)
    if value is None:
        raise StorageError(f"{path}: holds no {what}")
    if isinstance(value, tuple) and len(value) == 2:  # an eager Tensor: (name, array)
        value = value[1]
    array = numpy_pickle.read_array(value, path, what)
    size = itemsize(box.dtype)
    if array.dtype.itemsize != size:
        raise StorageError(f"{path}: {what} is stored as {array.dtype} ({array.dtype.itemsize} "
                           f"bytes an element), but the metadata says {box.dtype} ({size})")
    start, stop = box.flattened_range or (0, math.prod(box.local_shape))
    if array.nbytes != (stop - start) * size:
        shown = (f"elements [{start}, {stop}) of {list(box.local_shape)}"
                 if box.flattened_range else list(box.local_shape))
        raise StorageError(f"{path}: {what} holds {array.nbytes} bytes, but the metadata's "
                           f"{box.dtype} {shown} needs {(stop - start) * size}")
    mapped = files.open(path)
    if array.offset is None or (array.fortran and box.flattened_range is None
                                and len(box.local_shape) > 1):
        location = Stored(mapped, array.offset or 0, array.nbytes if array.offset is not None
                          else 0, _gather(array, box.local_shape))
        return [Chunk(box.local_shape, box.global_offset, box.dtype, path, location)]
    chunks = []
    for offset, shape, flat in flat_boxes(box.local_shape, start, stop):
        global_offset = tuple(o + s for o, s in zip(box.global_offset, offset))
        location = Stored(mapped, array.offset + (flat - start) * size, math.prod(shape) * size)
        chunks.append(Chunk(shape, global_offset, box.dtype, path, location))
    return chunks


def _gather(array: numpy_pickle.PickledArray, shape: tuple[int, ...]):
    """C-order bytes of an array stored in Fortran order, or held outside the file."""
    data = array.data

    def gather(_: memoryview) -> np.ndarray:
        raw = np.frombuffer(data, dtype=np.uint8)
        if not array.fortran:
            return raw
        # Fortran order: the bytes are a C-order array of the reversed shape, items last.
        axes = len(shape)
        reversed_shape = raw.reshape(*shape[::-1], array.dtype.itemsize)
        return np.ascontiguousarray(reversed_shape.transpose(*range(axes - 1, -1, -1), axes))
    return gather


def flat_boxes(shape: tuple[int, ...], start: int, stop: int
               ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [start, stop) of a C-order box of ``shape`` as boxes (offset in the box,
    shape, first element's flat index), each a contiguous run of those elements."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    first_row, first_column = divmod(start, inner)
    last_row, last_column = divmod(stop, inner)
    rest = shape[1:]

    def in_row(row: int, begin: int, end: int) -> list:
        return [((row, *offset), (1, *sub), row * inner + flat)
                for offset, sub, flat in flat_boxes(rest, begin, end)]

    if first_row == last_row:
        return in_row(first_row, first_column, last_column)
    boxes = []
    if first_column:
        boxes += in_row(first_row, first_column, inner)
        first_row += 1
    if last_row > first_row:
        boxes.append(((first_row, *(0 for _ in rest)), (last_row - first_row, *rest),
                      first_row * inner))
    if last_column:
        boxes += in_row(last_row, 0, last_column)
    return boxes


# -------------------------------------------------------------------------------- writing


class PaddleDestination(Destination):
    """One ``{rank}_0.distcp`` per rank, then ``0.metadata``."""

    format = "paddle"
    sharded = True
    patterns = ("*.distcp", "*.metadata")

    @classmethod
    def plan_files(cls, shards: Sequence[ShardDesc], ranks: Sequence[Sequence[int]] | None,
                   *, max_file_bytes: int | None = None) -> list[OutputFile]:
        """``{rank}_0.distcp`` (ranks counted from 0); without ranks, rank 0 holds all."""
        groups = [range(len(shards))] if ranks is None else ranks
        nbytes = shards_nbytes(shards)
        return [OutputFile(f"{rank}_0.distcp", tuple(indices),
                           sum(map(nbytes.__getitem__, indices)))
                for rank, indices in enumerate(groups)]

    def _owned(self) -> dict[str, list[int]]:
        """Each file's shards that it writes: a box held by several ranks goes in the first
        file that lists it."""
        seen: dict[tuple, str] = {}
        owned: dict[str, list[int]] = {}
        for file in self.files:
            keys: set[str] = set()
            owned[file.filename] = []
            for index in file.shards:
                shard = self.shards[index]
                box = (shard.key, shard.global_offset, shard.local_shape)
                if box in seen:
                    continue
                if shard.key in keys:
                    raise StorageError(f"{self.folder / file.filename}: holds two shards of "
                                       f"'{shard.key}'; a Paddle rank file holds one per key")
                keys.add(shard.key)
                seen[box] = file.filename
                owned[file.filename].append(index)
        return owned

    def layout(self, file: OutputFile) -> FileLayout:
        """The rank's pickle, each shard's bytes in a hole of it (the pickle says where)."""
        indices = self._owned()[file.filename]
        holes = {index: pickler.Hole(self.shards[index].nbytes) for index in indices}
        value: dict[str, Any] = {self.shards[i].key: numpy_pickle.array_value(
            self.shards[i].dtype or "float32", self.shards[i].local_shape, holes[i])
            for i in indices}
        value[NAME_TABLE] = {self.shards[i].key: self.shards[i].key for i in indices}
        laid = pickler.dumps(value)
        return FileLayout(laid.nbytes, [(offset, bytes(segment))
                                        for offset, segment in laid.segments],
                          [ShardSpan(i, laid.offset(holes[i]), holes[i].nbytes,
                                     itemsize(self.shards[i].dtype or "float32"))
                           for i in indices])

    def index(self) -> dict[str, bytes]:
        """``0.metadata``: every distinct box and the file holding it."""
        owned = self._owned()
        boxes = [(self.shards[index], name) for name, indices in owned.items()
                 for index in indices]
        return {"0.metadata": pickler.dumps(metadata_value(boxes)).bytes()}


FORMAT = Format("paddle", "PaddlePaddle FlexCheckpoint: {n}.metadata and {rank}_{n}.distcp",
                claims, open_paddle, PaddleDestination)
