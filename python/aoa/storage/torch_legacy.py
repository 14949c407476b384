"""``torch.save``'s legacy format, read without torch: files saved by PyTorch before 1.6, or
with ``_use_new_zipfile_serialization=False`` (the ``pytorch_model.bin`` of many models put on
the Hugging Face Hub in 2019-2020).

Such a file is five pickles one after another, then the storages' bytes:

1. torch's magic number; 2. the format's version, 1001; 3. the writer's facts (byte order,
   C type sizes); 4. the saved object, whose tensors are ``_rebuild_tensor_v2`` records as in
   the zip format and whose storages are persistent ids ``("storage", storage class, key,
   location, element count, view)``; 5. the storages' keys, sorted as strings;

then, for each key in that order, its element count (int64 in the writer's byte order) and
its bytes. A ``view`` (``(view key, offset, count)`` in elements, written by PyTorch before
0.4 for a slice of a storage) is that range of its root storage. Bytes after the last
storage are not read, as torch does not read them.

The object's pickle is read twice: first to learn its storages and where it ends (their
bytes lie after the keys' pickle that follows it), then with each storage's place known,
so that its tensors become `SavedTensor` records pointing into the file like the zip
format's (`aoa.storage.torch_save.saved_tensors`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aoa.dtypes import itemsize
from aoa.errors import StorageError
from aoa.storage import unpickler
from aoa.storage.torch_save import ALLOWED, SavedStorage, saved_tensors, storage_dtype
from aoa.storage.unpickler import shown

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
VERSION = 1001
#: The magic number as a pickle's LONG1 argument, bytes 4-14 of every legacy file saved with
#: pickle protocol 2 (torch's default) and found near the start of any other.
_MAGIC_BYTES = b"\x0a" + MAGIC_NUMBER.to_bytes(10, "little")


def is_legacy(head: bytes) -> bool:
    """Whether a file's first bytes are those of the legacy format (its pickled magic
    number)."""
    return head[:1] == b"\x80" and _MAGIC_BYTES in head[:32]


@dataclass(frozen=True)
class _Named:
    """A storage as the object's persistent ids name it."""

    dtype: str
    numel: int


def read_legacy(data: memoryview, where: str | Path) -> Any:
    """The object a legacy ``torch.save`` file holds, its tensors as `SavedTensor` records
    with offsets into ``data``."""
    magic, position = unpickler.load_one(data, where, {})
    if magic != MAGIC_NUMBER:
        raise StorageError(f"{where}: not a torch.save file: it starts with a pickle of "
                           f"{shown(magic)}, not torch's magic number")
    version, position = unpickler.load_one(data, where, {}, start=position)
    if version != VERSION:
        raise StorageError(f"{where}: torch.save legacy format version {shown(version)}; aoa "
                           f"reads version {VERSION}")
    facts, position = unpickler.load_one(data, where, {}, start=position)
    if not isinstance(facts, dict) or facts.get("little_endian") is not True:
        raise StorageError(f"{where}: the writer's facts {shown(facts)} do not say "
                           "little_endian = True; aoa reads little-endian files")
    named: dict[str, _Named] = {}
    object_start = position
    _, position = unpickler.load_one(
        data, where, ALLOWED, start=object_start,
        persistent_load=lambda pid: _name(pid, named, where))
    keys, position = unpickler.load_one(data, where, {}, start=position)
    storages = _storages(data, where, keys, named, position)
    saved, _ = unpickler.load_one(
        data, where, ALLOWED, start=object_start,
        persistent_load=lambda pid: _storage(pid, storages, where))
    return saved_tensors(saved, where)


def _name(pid: Any, named: dict[str, _Named], where: str | Path) -> None:
    """Note the storage ``pid`` names (first reading: nothing is built)."""
    key, dtype, numel, view = _parts(pid, where)
    found = named.setdefault(key, _Named(dtype, numel))
    if found != _Named(dtype, numel):
        raise StorageError(f"{where}: storage '{key}' is named as {found.numel} {found.dtype} "
                           f"elements and as {numel} {dtype} elements")
    if view is not None:
        view_key, offset, count = view
        if offset + count > numel:
            raise StorageError(f"{where}: view '{view_key}' of storage '{key}' takes elements "
                               f"[{offset}, {offset + count}) of its {numel}")


def _storage(pid: Any, storages: dict[str, SavedStorage], where: str | Path) -> SavedStorage:
    key, dtype, _, view = _parts(pid, where)
    root = storages[key]
    if view is None:
        return root
    view_key, offset, count = view
    size = itemsize(dtype)
    return SavedStorage(view_key, dtype, root.offset + offset * size, count * size)


def _parts(pid: Any, where: str | Path) -> tuple[str, str, int, tuple[str, int, int] | None]:
    """A legacy persistent id's storage key, dtype, element count and view, checked."""
    if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"
            and isinstance(pid[1], unpickler.RecordClass) and isinstance(pid[2], str)
            and _count(pid[4])):
        raise StorageError(f"{where}: persistent id {shown(pid)} is not a torch storage")
    _, cls, key, location, numel, view = pid
    dtype = storage_dtype(cls, key, location, where)
    if view is not None and not (isinstance(view, tuple) and len(view) == 3
                                 and isinstance(view[0], str) and _count(view[1])
                                 and _count(view[2])):
        raise StorageError(f"{where}: storage '{key}' has view {shown(view)}, not (key, "
                           "offset, count)")
    return key, dtype, numel, view


def _storages(data: memoryview, where: str | Path, keys: Any, named: dict[str, _Named],
              position: int) -> dict[str, SavedStorage]:
    """Each storage's bytes, found one after another from ``position`` in ``keys``' order,
    each behind its element count."""
    if not (isinstance(keys, list) and all(isinstance(key, str) for key in keys)):
        raise StorageError(f"{where}: the storages' keys are {shown(keys)}, not a list of "
                           "strings")
    if sorted(keys) != sorted(named) or len(set(keys)) != len(keys):
        raise StorageError(f"{where}: the storages' keys {shown(sorted(keys))} are not those "
                           f"the saved object names, {shown(sorted(named))}")
    storages: dict[str, SavedStorage] = {}
    for key in keys:
        found = named[key]
        if position + 8 > len(data):
            raise StorageError(f"{where}: truncated: storage '{key}' starts at byte {position}, "
                               f"past the file's {len(data)} bytes")
        (numel,) = struct.unpack_from("<q", data, position)
        if numel != found.numel:
            raise StorageError(f"{where}: storage '{key}' at byte {position} says it holds "
                               f"{numel} elements; the saved object says {found.numel}")
        position += 8
        nbytes = numel * itemsize(found.dtype)
        if position + nbytes > len(data):
            raise StorageError(f"{where}: truncated: storage '{key}' needs bytes [{position}, "
                               f"{position + nbytes}), past the file's {len(data)} bytes")
        storages[key] = SavedStorage(key, found.dtype, position, nbytes)
        position += nbytes
    return storages


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
