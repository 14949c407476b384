"""The ``dcp`` format: PyTorch Distributed Checkpoint (``torch.distributed.checkpoint.save`` with
its file system writer; torchtitan, FSDP2), read and written without torch.

A checkpoint is a folder of:

* ``.metadata``: a pickle of ``Metadata``: ``state_dict_metadata`` gives each key's dtype,
  global size and chunks (offsets and sizes), or marks it as bytes (a non-tensor object);
  ``storage_data`` maps each chunk (``MetadataIndex``: key and offsets) to a byte range of a
  data file (``_StorageInfo``: relative path, offset, length).
* ``__{rank}_{n}.distcp``: each chunk a complete ``torch.save`` archive of the chunk's tensor
  (`aoa.storage.torch_save`), the archives back to back.

Reading maps the data files and finds each chunk's bytes in its archive, in place. Objects
saved as bytes (a step count, a data loader's state, Megatron's sharded objects) are read as
the bytes they are stored as (`Source.objects`; never unpickled here), so a destination of
the same family writes them back unchanged. Archives transformed by DCP's stream extensions
(compression) are refused.

Writing: one ``__{rank}_0.distcp`` per rank, one archive per shard, each aligned to 64 bytes
and filled in place by the kernel, the objects after rank 0's archives; then ``.metadata``.
A box held by several ranks is written once, as DCP's planner keeps one copy.
"""

from __future__ import annotations

import itertools
import math
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

from aoa.errors import StorageError
from aoa.layout import ShardDesc, shards_nbytes
from aoa.limits import usable_cpus
from aoa.storage import pickler, unpickler
from aoa.storage.chunks import Chunk, key_shards
from aoa.storage.formats import (
    Destination,
    Expect,
    FileLayout,
    Fill,
    Format,
    OutputFile,
    Piece,
)
from aoa.storage.in_place import InPlaceWriter
from aoa.storage.mapped import MappedFiles, MappedSource, Stored
from aoa.storage.pickler import PAYLOAD_ALIGNMENT, Build, Call, Global, New
from aoa.storage.torch_save import (
    TORCH_DTYPES,
    SavedTensor,
    TensorToSave,
    TorchSaveLayout,
    check_torch_save,
    read_torch_save,
    stored,
)

METADATA_NAME = ".metadata"
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_PLANNER = "torch.distributed.checkpoint.planner"
#: The version DCP 2.x writes.
DCP_VERSION = "1.0.0"

ALLOWED: unpickler.Allowed = unpickler.records(
    *(f"{_MD}.{name}" for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    f"{_FS}._StorageInfo", f"{_FS}._StoragePrefix",
    # Megatron-Core keeps every rank's save plan in the metadata (not read here)
    *(f"{_PLANNER}.{name}" for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")),
    "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata",
    "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan",
    "torch.Size", "torch.serialization._get_layout", "torch.device",
    "pathlib.PosixPath", "pathlib.PurePosixPath", "pathlib.WindowsPath",
    *(f"torch.{name}" for name in TORCH_DTYPES),
)


# ------------------------------------------------------------------------------- metadata


@dataclass(frozen=True)
class DcpChunk:
    """A stored chunk of a key and the byte range of its archive."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    key: str
    dtype: str
    size: tuple[int, ...]
    chunks: list[DcpChunk]


@dataclass(frozen=True)
class DcpObject:
    """An item saved as bytes, and where its bytes are."""

    key: str
    file: str
    offset: int
    length: int


def read_metadata(data: memoryview, where: Path
                  ) -> tuple[dict[str, DcpTensor], dict[str, DcpObject]]:
    """The tensors of the metadata pickle at ``where`` (every field checked), and the items
    saved as bytes."""
    fields = unpickler.fields(unpickler.load_metadata(data, where, ALLOWED),
                              f"{_MD}.Metadata", where, "the metadata")
    state, storage = fields.get("state_dict_metadata"), fields.get("storage_data")
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise StorageError(f"{where}: the metadata has no state_dict_metadata and "
                           "storage_data dicts")
    places = _storage_places(storage, where)
    tensors: dict[str, DcpTensor] = {}
    objects: dict[str, DcpObject] = {}
    for key, entry in state.items():
        key = unpickler.string(key, where, "a key of state_dict_metadata")
        if unpickler.is_record(entry, f"{_MD}.BytesStorageMetadata"):
            place = places.get((key, None))
            if place is None:
                raise StorageError(f"{where}: the object '{key}' has no entry in storage_data")
            objects[key] = DcpObject(key, *place)
            continue
        tensors[key] = _tensor(key, entry, places, where)
    return tensors, objects


def _storage_places(storage: dict, where: Path) -> dict[tuple[str, tuple[int, ...] | None],
                                                        tuple[str, int, int]]:
    places = {}
    for index, info in storage.items():
        fields = unpickler.fields(index, f"{_MD}.MetadataIndex", where,
                                  "a key of storage_data")
        key = unpickler.string(fields.get("fqn"), where, "MetadataIndex.fqn")
        offset = fields.get("offset")
        offsets = None if offset is None else unpickler.int_tuple(
            offset, where, f"MetadataIndex of '{key}': offset")
        what = f"the storage of '{key}'"
        info_fields = unpickler.fields(info, f"{_FS}._StorageInfo", where, what)
        if info_fields.get("transform_descriptors"):
            raise StorageError(f"{where}: {what} is transformed by "
                               f"{info_fields['transform_descriptors']!r} (a DCP stream "
                               "extension), which aoa does not read")
        path = unpickler.string(info_fields.get("relative_path"), where, f"{what}: path")
        if Path(path).name != path or not path:
            raise StorageError(f"{where}: {what} names file '{path}', not a name inside the "
                               "folder")
        start, length = unpickler.int_tuple(
            (info_fields.get("offset"), info_fields.get("length")), where,
            f"{what}: offset and length")
        places[(key, offsets)] = (path, start, length)
    _check_apart(places, where)
    return places


def _check_apart(places: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]],
                 where: Path) -> None:
    """No two items' bytes overlap: DCP writes each archive once, back to back, so two
    items reading the same bytes mean the metadata lies about one of them."""
    for first, second in itertools.pairwise(sorted(places.values())):
        path, start, length = first
        if second[1] < start + length and second[0] == path:
            item = next(item for item, place in places.items() if place == first)
            other = next(other for other, place in places.items()
                         if place == second and other != item)
            raise StorageError(f"{where}: storage_data places {_item(item)} at bytes "
                               f"[{start}, {start + length}) and {_item(other)} at "
                               f"[{second[1]}, {second[1] + second[2]}) of '{path}', "
                               "which overlap")


def _item(item: tuple[str, tuple[int, ...] | None]) -> str:
    key, offsets = item
    return f"the object '{key}'" if offsets is None else \
        f"the chunk of '{key}' at {list(offsets)}"


def _tensor(key: str, entry: Any, places: dict, where: Path) -> DcpTensor:
    what = f"TensorStorageMetadata of '{key}'"
    fields = unpickler.fields(entry, f"{_MD}.TensorStorageMetadata", where, what)
    size = unpickler.int_tuple(fields.get("size"), where, f"{what}: size")
    dtype = _dtype(fields.get("properties"), where, what)
    chunks_value = fields.get("chunks")
    if not isinstance(chunks_value, list):
        raise StorageError(f"{where}: {what} has no list of chunks")
    chunks = []
    for chunk in chunks_value:
        chunk_fields = unpickler.fields(chunk, f"{_MD}.ChunkStorageMetadata", where,
                                        f"a chunk of '{key}'")
        offsets = unpickler.int_tuple(chunk_fields.get("offsets"), where,
                                      f"a chunk of '{key}': offsets", size=len(size))
        sizes = unpickler.int_tuple(chunk_fields.get("sizes"), where,
                                    f"a chunk of '{key}': sizes", size=len(size))
        place = places.get((key, offsets))
        if place is None:
            raise StorageError(f"{where}: the chunk of '{key}' at {list(offsets)} has no "
                               "entry in storage_data")
        chunks.append(DcpChunk(key, offsets, sizes, *place))
    return DcpTensor(key, dtype, size, chunks)


def _dtype(properties: Any, where: Path, what: str) -> str:
    if not unpickler.is_record(properties, f"{_MD}.TensorProperties"):
        raise StorageError(f"{where}: {what} has no TensorProperties")
    state = properties.state
    value = state[0] if isinstance(state, tuple) and state else (
        state.get("dtype") if isinstance(state, dict) else None)
    if not (isinstance(value, unpickler.RecordClass) and value.module == "torch"
            and value.name in TORCH_DTYPES):
        raise StorageError(f"{where}: {what} has dtype {value!r}, which aoa does not read")
    return TORCH_DTYPES[value.name]


def metadata_value(boxes: Sequence[tuple[ShardDesc, str, int, int]],
                   objects: Sequence[DcpObject] = ()) -> Build:
    """The pickle of ``Metadata`` for (box, file name, archive offset, archive length) and
    the objects saved as bytes."""
    layout = Call(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Call(Global(_MD, "_MEM_FORMAT_ENCODING"), (0,))
    tensors: dict[str, dict[str, Any]] = {}
    storage: list[tuple[Build, Build]] = []
    for shard, file, offset, length in boxes:
        entry = tensors.get(shard.key)
        if entry is None:
            properties = Build(New(Global(_MD, "TensorProperties")), (
                Global("torch", shard.dtype or "float32"), layout, False, contiguous, False))
            entry = tensors[shard.key] = {"properties": properties,
                                          "size": _size(shard.global_shape), "chunks": []}
        entry["chunks"].append(Build(New(Global(_MD, "ChunkStorageMetadata")), {
            "offsets": _size(shard.global_offset), "sizes": _size(shard.local_shape)}))
        index = Build(New(Global(_MD, "MetadataIndex")), {
            "fqn": shard.key, "offset": _size(shard.global_offset),
            "index": len(entry["chunks"]) - 1})
        storage.append((index, Build(New(Global(_FS, "_StorageInfo")), {
            "relative_path": file, "offset": offset, "length": length})))
    state: dict[str, Build] = {key: Build(New(Global(_MD, "TensorStorageMetadata")), entry)
                               for key, entry in tensors.items()}
    for item in objects:
        state[item.key] = Build(New(Global(_MD, "BytesStorageMetadata")), {})
        index = Build(New(Global(_MD, "MetadataIndex")), {
            "fqn": item.key, "offset": None, "index": None})
        storage.append((index, Build(New(Global(_FS, "_StorageInfo")), {
            "relative_path": item.file, "offset": item.offset, "length": item.length})))
    return Build(New(Global(_MD, "Metadata")), {
        "state_dict_metadata": state,
        "planner_data": {key: (key,) for key in state},
        "storage_data": pickler.Pairs(tuple(storage)),
        "storage_meta": Build(New(Global(_MD, "StorageMeta")), {
            "checkpoint_id": None, "save_id": str(uuid.uuid4()), "load_id": None,
            "modules": []}),
        "version": DCP_VERSION,
    })


def _size(values: tuple[int, ...]) -> Call:
    return Call(Global("torch", "Size"), (values,))


# -------------------------------------------------------------------------------- reading


class DcpSource(MappedSource):
    """An open DCP checkpoint: the mapped data files and where each chunk's bytes lie."""

    def __init__(self, path: Path, format: str, metadata: Path, files: MappedFiles,
                 stored: dict[str, list[tuple[ShardDesc, Stored]]],
                 objects: dict[str, DcpObject]) -> None:
        super().__init__(path, format, stored)
        self.metadata = metadata
        self._objects = objects
        self._files = files

    def objects(self) -> dict[str, bytes]:
        return {key: bytes(self._files.open(self.metadata.parent / item.file).view(
                    item.offset, item.length)) for key, item in self._objects.items()}

    def files(self) -> list[Path]:
        return sorted([self.metadata, *self._files.files])


def claims(path: Path) -> bool:
    """A folder with DCP's ``.metadata`` (and not Megatron-Core's ``metadata.json``)."""
    return (path.is_dir() and (path / METADATA_NAME).is_file()
            and not (path / "metadata.json").is_file())


def open_dcp(path: Path, *, format: str = "dcp",
             source: type[DcpSource] = DcpSource) -> DcpSource:
    """Open the DCP checkpoint in folder ``path`` (as ``source``, for formats built on it)."""
    folder = path.parent if path.is_file() and path.name == METADATA_NAME else path
    metadata_path = folder / METADATA_NAME
    if not metadata_path.is_file():
        raise StorageError(f"{folder}: no {METADATA_NAME} file (PyTorch DCP) in this folder")
    files = MappedFiles()
    try:
        tensors, objects = read_metadata(files.open(metadata_path).data, metadata_path)
        files.close()
        for item in objects.values():
            _check_object(item, metadata_path, files)
        stored = {key: _key_shards(tensor, metadata_path, files)
                  for key, tensor in tensors.items()}
        return source(folder, format, metadata_path, files, stored, objects)
    except BaseException:
        files.close()
        raise


def _check_object(item: DcpObject, where: Path, files: MappedFiles) -> None:
    path = where.parent / item.file
    if not path.is_file():
        raise StorageError(f"{where}: names data file '{item.file}' (for '{item.key}'), "
                           "which does not exist")
    size = files.open(path).size
    if item.offset + item.length > size:
        raise StorageError(f"{path}: truncated: the object '{item.key}' needs bytes "
                           f"[{item.offset}, {item.offset + item.length}) of a file of {size}")
    check_torch_save(files.open(path).data, f"{path}: the object '{item.key}' at bytes "
                     f"[{item.offset}, {item.offset + item.length})", item.offset,
                     item.offset + item.length)


def _key_shards(tensor: DcpTensor, where: Path,
                files: MappedFiles) -> list[tuple[ShardDesc, Stored]]:
    chunks = []
    for chunk in tensor.chunks:
        path = where.parent / chunk.file
        if not path.is_file():
            raise StorageError(f"{where}: names data file '{chunk.file}' (for '{tensor.key}'), "
                               "which does not exist")
        mapped = files.open(path)
        if chunk.offset + chunk.length > mapped.size:
            raise StorageError(f"{path}: truncated: the chunk of '{tensor.key}' at "
                               f"{list(chunk.offsets)} needs bytes [{chunk.offset}, "
                               f"{chunk.offset + chunk.length}) of a file of {mapped.size}")
        saved = read_torch_save(mapped.data, path, chunk.offset, chunk.offset + chunk.length)
        what = f"the chunk of '{tensor.key}' at {list(chunk.offsets)}"
        if not isinstance(saved, SavedTensor):
            raise StorageError(f"{path}: {what} holds a {type(saved).__name__}, not a tensor")
        if saved.dtype != tensor.dtype or saved.shape != chunk.sizes:
            raise StorageError(f"{path}: {what} is {saved.dtype} {list(saved.shape)}, but the "
                               f"metadata says {tensor.dtype} {list(chunk.sizes)}")
        chunks.append(Chunk(chunk.sizes, chunk.offsets, tensor.dtype, path,
                            stored(saved, mapped)))
    if not chunks:
        raise StorageError(f"{where}: tensor '{tensor.key}' has no chunks")
    return cast(list[tuple[ShardDesc, Stored]], key_shards(tensor.key, chunks, tensor.size))


# -------------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class _Item:
    """A shard's archive in a data file."""

    shard: int
    offset: int
    layout: TorchSaveLayout


class DcpDestination(Destination):
    """One ``__{rank}_0.distcp`` per rank, one ``torch.save`` archive per shard; then
    ``.metadata``."""

    format = "dcp"
    sharded = True
    patterns: ClassVar[tuple[str, ...]] = ("*.distcp", METADATA_NAME)
    objects_family: ClassVar[frozenset[str]] = frozenset({"dcp", "torch_dist"})

    @classmethod
    def plan_files(cls, shards: Sequence[ShardDesc], ranks: Sequence[Sequence[int]] | None,
                   *, max_file_bytes: int | None = None) -> list[OutputFile]:
        """``__{rank}_0.distcp`` (ranks from 0); without ranks, rank 0 holds every shard."""
        groups = [range(len(shards))] if ranks is None else ranks
        nbytes = shards_nbytes(shards)
        return [OutputFile(f"__{rank}_0.distcp", tuple(indices),
                           sum(map(nbytes.__getitem__, indices)))
                for rank, indices in enumerate(groups)]

    def _items(self) -> dict[str, tuple[list[_Item], int]]:
        """Each file's archives (a box held by several ranks only in the first file that
        lists it) and the file's size; the first file's size includes the objects."""
        seen: set[tuple] = set()
        laid: dict[str, tuple[list[_Item], int]] = {}
        for number, file in enumerate(self.files):
            items, position = [], 0
            for index in file.shards:
                shard = self.shards[index]
                box = (shard.key, shard.global_offset, shard.local_shape)
                if box in seen:
                    continue
                seen.add(box)
                layout = TorchSaveLayout([TensorToSave(shard.dtype or "float32",
                                                       shard.local_shape)], base=position)
                items.append(_Item(index, position, layout))
                position += math.ceil(layout.nbytes / PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT
            if number == 0:
                position += sum(len(data) for data in self.objects.values())
            laid[file.filename] = (items, position)
        return laid

    def layout(self, file: OutputFile) -> FileLayout:
        raise NotImplementedError("DCP files are written through a mapping (write_file)")

    def _objects(self) -> list[DcpObject]:
        """Where the objects go: one after another, after the first file's archives."""
        if not self.objects or not self.files:
            return []
        first = self.files[0].filename
        position = self._items()[first][1] - sum(len(d) for d in self.objects.values())
        placed = []
        for key, data in self.objects.items():
            placed.append(DcpObject(key, first, position, len(data)))
            position += len(data)
        return placed

    def write_file(self, path: Path, file: OutputFile, fill: Fill, buffers: object,
                   expect: Expect | None = None) -> None:
        """Through a mapping of the whole file: each archive's descriptors and central
        directory carry the CRC-32 of its tensor's bytes, known once they are filled."""
        items, nbytes = self._items()[file.filename]
        writer = InPlaceWriter(path, nbytes)
        try:
            if expect is not None:  # one fill: its sources read ahead as its copies go
                import numpy as np

                expect(np.array([item.shard for item in items], np.int64))
            fill([Piece(item.shard, writer.view(item.offset + item.layout.data_offset(0),
                                                self.shards[item.shard].nbytes))
                  for item in items])
            # headers and CRC-32s, archives in parallel (zlib releases the GIL)
            views = [writer.view(item.offset, item.layout.nbytes) for item in items]
            with ThreadPoolExecutor(usable_cpus()) as pool:
                list(pool.map(lambda item, view: item.layout.write(view), items, views))
            for placed in self._objects():
                if placed.file == file.filename:
                    writer.view(placed.offset, placed.length)[:] = self.objects[placed.key]
            writer.commit()
        except BaseException:
            writer.discard()
            raise

    def index(self) -> dict[str, bytes]:
        """``.metadata``: every distinct box and its archive's place."""
        boxes = [(self.shards[item.shard], name, item.offset, item.layout.nbytes)
                 for name, (items, _) in self._items().items() for item in items]
        return {METADATA_NAME: pickler.dumps(metadata_value(boxes, self._objects())).bytes()}


FORMAT = Format("dcp", "PyTorch Distributed Checkpoint: .metadata and __{rank}_{n}.distcp",
                claims, open_dcp, DcpDestination)
