"""Uncompressed zip archives as ``torch.save`` writes them: records located in place, and laid
out for writing with their data aligned.

``torch.save`` stores every record uncompressed (method 0), its data aligned to 64 bytes by
padding in the local header's extra field, each followed by a data descriptor, with zip64
end records. Reading needs only the central directory and the local headers: every record is
then a byte range of the file (nothing is copied, nothing decompressed). Writing lays the
records out first (each record's data offset known before any byte is written, so a kernel
can fill the data in place), then writes the headers once the data, and so its CRC-32, is
final.

Offsets here are relative to the archive's first byte: a ``.distcp`` file of PyTorch DCP
holds many archives back to back, each read at its own offset.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aoa.errors import StorageError

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # signature ... name length, extra length
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_END64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_DESCRIPTOR32 = struct.Struct("<IIII")
_DESCRIPTOR64 = struct.Struct("<IIQQ")
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_END64_SIG, _LOCATOR64_SIG, _DESCRIPTOR_SIG = 0x06064B50, 0x07064B50, 0x08074B50
_U32, _U16 = 0xFFFFFFFF, 0xFFFF
_ZIP64_EXTRA = 0x0001
#: Flags torch.save sets: a data descriptor follows the data; names are UTF-8.
_FLAGS = 0x0808
_PADDING_EXTRA = b"FB"


@dataclass(frozen=True)
class StoredRecord:
    """A record of the archive: its name and its data's byte range."""

    name: str
    offset: int
    nbytes: int


def read_records(data: memoryview, where: str | Path, start: int = 0,
                 end: int | None = None) -> dict[str, StoredRecord]:
    """The records of the archive in ``data[start:end]``, by name, with offsets into
    ``data``; every range checked to lie inside the archive."""
    end = len(data) if end is None else end
    size = end - start
    if size < _END.size:
        raise StorageError(f"{where}: truncated: {size} bytes are too few for a zip archive")
    tail_start = max(start, end - _END.size - 0xFFFF)
    tail = bytes(data[tail_start:end])
    found = tail.rfind(struct.pack("<I", _END_SIG))
    if found < 0 or len(tail) - found < _END.size:
        raise StorageError(f"{where}: not a zip archive (no end of central directory); "
                           "truncated, or not written by torch.save")
    (_, _, _, _, entries, directory_size, directory_offset, _) = _END.unpack_from(tail, found)
    end_record = tail_start + found
    if _U32 in (directory_size, directory_offset) or entries == _U16:
        entries, directory_size, directory_offset = _zip64_end(data, where, start, end_record)
    if directory_offset + directory_size > end_record - start:
        raise StorageError(f"{where}: truncated: the zip central directory "
                           f"[{directory_offset}, {directory_offset + directory_size}) runs "
                           f"past the archive's {size} bytes")
    records: dict[str, StoredRecord] = {}
    position = start + directory_offset
    for _ in range(entries):
        record, position = _central_entry(data, where, start, end, position)
        if record.name in records:
            raise StorageError(f"{where}: zip record '{record.name}' appears twice")
        records[record.name] = record
    return records


def _zip64_end(data: memoryview, where: str | Path, start: int,
               end_record: int) -> tuple[int, int, int]:
    locator = end_record - _LOCATOR64.size
    if locator < start:
        raise StorageError(f"{where}: zip64 archive without its end locator")
    signature, _, end64_offset, _ = _LOCATOR64.unpack_from(data, locator)
    if signature != _LOCATOR64_SIG or start + end64_offset + _END64.size > locator:
        raise StorageError(f"{where}: zip64 end locator is damaged")
    fields = _END64.unpack_from(data, start + end64_offset)
    if fields[0] != _END64_SIG:
        raise StorageError(f"{where}: zip64 end of central directory is damaged")
    return fields[7], fields[8], fields[9]


def _central_entry(data: memoryview, where: str | Path, start: int, end: int,
                   position: int) -> tuple[StoredRecord, int]:
    if position + _CENTRAL.size > end:
        raise StorageError(f"{where}: truncated: zip central directory ends early")
    (signature, _, _, flags, method, _, _, _, compressed, size, name_length, extra_length,
     comment_length, _, _, _, local_offset) = _CENTRAL.unpack_from(data, position)
    if signature != _CENTRAL_SIG:
        raise StorageError(f"{where}: zip central directory is damaged at byte {position}")
    name_start = position + _CENTRAL.size
    following = name_start + name_length + extra_length + comment_length
    if following > end:
        raise StorageError(f"{where}: truncated: zip central directory ends early")
    name = bytes(data[name_start:name_start + name_length]).decode("utf-8", "replace")
    extra = bytes(data[name_start + name_length:name_start + name_length + extra_length])
    size, compressed, local_offset = _zip64_sizes(extra, size, compressed, local_offset)
    if method != 0 or compressed != size:
        raise StorageError(f"{where}: zip record '{name}' is compressed; torch.save stores "
                           "records uncompressed, and so must a file aoa reads")
    if flags & 0x1:
        raise StorageError(f"{where}: zip record '{name}' is encrypted")
    local = start + local_offset
    if local + _LOCAL.size > end:
        raise StorageError(f"{where}: truncated: zip record '{name}' has its header at "
                           f"byte {local_offset}, past the archive's end")
    fields = _LOCAL.unpack_from(data, local)
    if fields[0] != _LOCAL_SIG:
        raise StorageError(f"{where}: zip record '{name}' has a damaged local header")
    data_offset = local + _LOCAL.size + fields[9] + fields[10]
    if data_offset + size > end:
        raise StorageError(f"{where}: truncated: zip record '{name}' needs bytes "
                           f"[{data_offset - start}, {data_offset - start + size}) of an "
                           f"archive of {end - start}")
    return StoredRecord(name, data_offset, size), following


def _zip64_sizes(extra: bytes, size: int, compressed: int,
                 offset: int) -> tuple[int, int, int]:
    """Sizes and offset, taken from the zip64 extra field where the 32-bit fields overflow."""
    position = 0
    while position + 4 <= len(extra):
        kind, length = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4:position + 4 + length]
        if kind == _ZIP64_EXTRA:
            values = [v for (v,) in struct.iter_unpack("<Q", body[:len(body) // 8 * 8])]
            if size == _U32 and values:
                size = values.pop(0)
            if compressed == _U32 and values:
                compressed = values.pop(0)
            if offset == _U32 and values:
                offset = values.pop(0)
        position += 4 + length
    return size, compressed, offset


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class PlannedRecord:
    """A record of an archive being written: where its local header and its data go."""

    name: str
    header: int
    offset: int
    nbytes: int


class ZipLayout:
    """Where every record of an archive goes, before any byte is written. ``write`` then
    writes the headers, descriptors and central directory around the filled data."""

    def __init__(self, records: Sequence[tuple[str, int]], alignment: int = 64,
                 base: int = 0) -> None:
        """``records``: (name, size in bytes), in order; ``base``: where the archive starts
        in its file, so that data is aligned to ``alignment`` in the file."""
        self.base = base
        self.records: list[PlannedRecord] = []
        self._crcs: dict[str, int] = {}
        position = 0
        for name, nbytes in records:
            encoded = name.encode("utf-8")
            bare = position + _LOCAL.size + len(encoded) + 4
            padding = -(base + bare) % alignment
            offset = bare + padding
            self.records.append(PlannedRecord(name, position, offset, nbytes))
            position = offset + nbytes + _descriptor_size(position, nbytes)
        self.directory_offset = position
        self.directory = b"".join(self._central(record) for record in self.records)
        self.nbytes = position + len(self.directory) + _END64.size + _LOCATOR64.size + _END.size

    def record(self, name: str) -> PlannedRecord:
        for record in self.records:
            if record.name == name:
                return record
        raise KeyError(name)

    def write(self, out: memoryview) -> None:
        """Write the headers into ``out`` (the archive's bytes, its data already filled)."""
        for record in self.records:
            name = record.name.encode("utf-8")
            extra_length = record.offset - record.header - _LOCAL.size - len(name)
            padding = _PADDING_EXTRA + struct.pack("<H", extra_length - 4) + bytes(
                extra_length - 4)
            header = _LOCAL.pack(_LOCAL_SIG, 0, _flags(record.nbytes), 0, 0, 0, 0, 0, 0,
                                 len(name), extra_length) + name + padding
            out[record.header:record.offset] = header
            crc = zlib.crc32(out[record.offset:record.offset + record.nbytes])
            end = record.offset + record.nbytes
            descriptor_size = _descriptor_size(record.header, record.nbytes)
            if descriptor_size == 0:
                descriptor = b""
            elif descriptor_size == _DESCRIPTOR64.size:
                descriptor = _DESCRIPTOR64.pack(_DESCRIPTOR_SIG, crc, record.nbytes,
                                                record.nbytes)
            else:
                descriptor = _DESCRIPTOR32.pack(_DESCRIPTOR_SIG, crc, record.nbytes,
                                                record.nbytes)
            out[end:end + len(descriptor)] = descriptor
            self._crcs[record.name] = crc
        directory = b"".join(self._central(record) for record in self.records)
        position = self.directory_offset
        out[position:position + len(directory)] = directory
        position += len(directory)
        count = len(self.records)
        end64 = _END64.pack(_END64_SIG, _END64.size - 12, 0x031E, 45, 0, 0, count, count,
                            len(directory), self.directory_offset)
        locator = _LOCATOR64.pack(_LOCATOR64_SIG, 0, position, 1)
        end_record = _END.pack(_END_SIG, 0, 0, min(count, _U16), min(count, _U16),
                               min(len(directory), _U32), min(self.directory_offset, _U32), 0)
        tail = end64 + locator + end_record
        out[position:position + len(tail)] = tail

    def _central(self, record: PlannedRecord) -> bytes:
        name = record.name.encode("utf-8")
        crc = self._crcs.get(record.name, 0)
        large = record.nbytes >= _U32 or record.header >= _U32
        extra = b""
        sizes = (record.nbytes, record.nbytes, record.header)
        if large:
            extra = struct.pack("<HHQQQ", _ZIP64_EXTRA, 24, *sizes)
            sizes = (_U32, _U32, _U32)
        return _CENTRAL.pack(_CENTRAL_SIG, 0x031E, 45 if large else 20, _flags(record.nbytes),
                             0, 0, 0, crc,
                             sizes[1], sizes[0], len(name), len(extra), 0, 0, 0, 0,
                             sizes[2]) + name + extra


def _descriptor_size(header: int, nbytes: int) -> int:
    """As miniz writes it (and torch.load's offset arithmetic expects): none for an empty
    record, 24 bytes when the size or the header's offset needs 64 bits, else 16."""
    if nbytes == 0:
        return 0
    return _DESCRIPTOR64.size if header >= _U32 or nbytes >= _U32 else _DESCRIPTOR32.size


def _flags(nbytes: int) -> int:
    return _FLAGS if nbytes else _FLAGS & ~0x0008
