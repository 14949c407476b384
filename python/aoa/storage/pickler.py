"""Writing the pickles checkpoints are made of, from plain values, without the frameworks.

A pickle is written from a tree of plain values (None, bools, ints, floats, strings, bytes,
tuples, lists, dicts) and a few nodes that say what the framework's own pickler would have
written: `Global` (a class or constant by name), `Call` (REDUCE), `New` (NEWOBJ),
`Build` (state given to an object) and `PersistentId` (``torch.save``'s storages).

A `Hole` is a payload of bytes not known yet (a tensor): the pickle is laid out with room for
it, aligned in the file, and the caller's kernel fills it in place, so no tensor is ever
copied into a pickle. Globals are memoized, so a large metadata pickle names each class once.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: Payloads start at a multiple of this many bytes in the file (a cache line, as torch.save).
PAYLOAD_ALIGNMENT = 64


@dataclass(frozen=True)
class Global:
    """A class, function or constant named by module and name (``torch.float32``)."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """``func(*args)``: REDUCE."""

    func: Any
    args: tuple


@dataclass(frozen=True)
class New:
    """``cls.__new__(cls, *args)``: NEWOBJ, as dataclasses and ``copyreg`` pickle."""

    cls: Global
    args: tuple = ()


@dataclass(frozen=True)
class Build:
    """``obj`` given ``state`` (BUILD): a dataclass's field dict, or ``__getstate__``'s value."""

    obj: Any
    state: Any


@dataclass(frozen=True)
class Pairs:
    """A dict given as (key, value) pairs: keys may be nodes (a dataclass as a key)."""

    items: tuple[tuple[Any, Any], ...]


@dataclass(frozen=True)
class PersistentId:
    """An object the pickle refers to outside itself (BINPERSID)."""

    value: Any


@dataclass(frozen=True, eq=False)
class Hole:
    """``nbytes`` of bytes the caller fills later, stored as a bytes object."""

    nbytes: int


@dataclass
class Pickled:
    """A laid-out pickle: its bytes as segments (offset, bytes) around the holes, where each
    hole's payload starts, and its whole size; offsets count from the pickle's first byte."""

    segments: list[tuple[int, bytes]]
    holes: dict[int, int]  # id(hole) -> offset
    nbytes: int

    def offset(self, hole: Hole) -> int:
        return self.holes[id(hole)]

    def bytes(self) -> bytes:
        """The whole pickle, holes as zeros (for pickles without large holes)."""
        data = bytearray(self.nbytes)
        for offset, segment in self.segments:
            data[offset:offset + len(segment)] = segment
        return bytes(data)


def dumps(value: Any, *, protocol: int = 4, base: int = 0) -> Pickled:
    """Lay out the pickle of ``value``; ``base`` is where it will start in its file, so that
    holes can be aligned to `PAYLOAD_ALIGNMENT` there."""
    writer = _Writer(protocol, base)
    writer.out += b"\x80" + bytes([protocol])
    writer.write(value)
    writer.out += b"."
    writer.segments.append((writer.start, bytes(writer.out)))
    return Pickled(writer.segments, writer.holes, writer.position)


class _Writer:
    def __init__(self, protocol: int, base: int) -> None:
        if protocol not in (2, 3, 4):
            raise ValueError(f"pickle protocol {protocol} is not written here")
        self.protocol = protocol
        self.base = base
        self.out = bytearray()  # the segment being written, from ``start``
        self.start = 0
        self.segments: list[tuple[int, bytes]] = []
        self.holes: dict[int, int] = {}
        self.memo: dict[Global, int] = {}

    @property
    def position(self) -> int:
        return self.start + len(self.out)

    def write(self, value: Any) -> None:
        if value is None:
            self.out += b"N"
        elif value is True:
            self.out += b"\x88"
        elif value is False:
            self.out += b"\x89"
        elif isinstance(value, int):
            self.integer(value)
        elif isinstance(value, float):
            self.out += b"G" + struct.pack(">d", value)
        elif isinstance(value, str):
            self.text(value)
        elif isinstance(value, (bytes, bytearray)):
            self.bytes_(bytes(value))
        elif isinstance(value, tuple):
            self.tuple_(value)
        elif isinstance(value, list):
            self.out += b"]"
            for chunk in _batches(value):
                self.out += b"("
                for item in chunk:
                    self.write(item)
                self.out += b"e"
        elif isinstance(value, (dict, Pairs)):
            self.out += b"}"
            pairs = list(value.items() if isinstance(value, dict) else value.items)
            for chunk in _batches(pairs):
                self.out += b"("
                for key, item in chunk:
                    self.write(key)
                    self.write(item)
                self.out += b"u"
        elif isinstance(value, Global):
            self.global_(value)
        elif isinstance(value, Call):
            self.write(value.func)
            self.tuple_(value.args)
            self.out += b"R"
        elif isinstance(value, New):
            self.global_(value.cls)
            self.tuple_(value.args)
            self.out += b"\x81"
        elif isinstance(value, Build):
            self.write(value.obj)
            self.write(value.state)
            self.out += b"b"
        elif isinstance(value, PersistentId):
            self.write(value.value)
            self.out += b"Q"
        elif isinstance(value, Hole):
            self.hole(value)
        else:
            raise TypeError(f"cannot pickle {type(value).__name__}")

    def integer(self, value: int) -> None:
        if 0 <= value < 256:
            self.out += b"K" + bytes([value])
        elif 0 <= value < 65536:
            self.out += b"M" + struct.pack("<H", value)
        elif -(2**31) <= value < 2**31:
            self.out += b"J" + struct.pack("<i", value)
        else:
            encoded = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(encoded)]) + encoded

    def text(self, value: str) -> None:
        encoded = value.encode("utf-8", "surrogatepass")
        if self.protocol >= 4 and len(encoded) < 256:
            self.out += b"\x8c" + bytes([len(encoded)]) + encoded
        else:
            self.out += b"X" + struct.pack("<I", len(encoded)) + encoded

    def bytes_(self, value: bytes) -> None:
        if self.protocol < 3:
            raise TypeError("bytes need pickle protocol 3 or newer")
        if len(value) < 256:
            self.out += b"C" + bytes([len(value)]) + value
        else:
            self.out += b"B" + struct.pack("<I", len(value)) + value

    def tuple_(self, items: tuple) -> None:
        if len(items) <= 3:
            for item in items:
                self.write(item)
            self.out += (b")", b"\x85", b"\x86", b"\x87")[len(items)]
            return
        self.out += b"("
        for item in items:
            self.write(item)
        self.out += b"t"

    def global_(self, name: Global) -> None:
        index = self.memo.get(name)
        if index is not None:
            self.out += b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)
            return
        if self.protocol >= 4:
            self.text(name.module)
            self.text(name.name)
            self.out += b"\x93"
        else:
            self.out += b"c" + f"{name.module}\n{name.name}\n".encode()
        index = len(self.memo)
        self.memo[name] = index
        if self.protocol >= 4:
            self.out += b"\x94"
        else:
            self.out += b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)

    def hole(self, hole: Hole) -> None:
        """BINBYTES8 (BINBYTES before protocol 4), preceded by a padding bytes object that is
        popped at once, so that the payload starts at an aligned position in the file."""
        if self.protocol < 3:
            raise TypeError("payloads need pickle protocol 3 or newer")
        header = 9 if self.protocol >= 4 else 5
        pad = -(self.base + self.position + 3 + header) % PAYLOAD_ALIGNMENT
        self.out += b"C" + bytes([pad]) + bytes(pad) + b"0"
        if self.protocol >= 4:
            self.out += b"\x8e" + struct.pack("<Q", hole.nbytes)
        else:
            if hole.nbytes >= 2**32:
                raise ValueError("a payload of 4 GiB or more needs pickle protocol 4")
            self.out += b"B" + struct.pack("<I", hole.nbytes)
        offset = self.position
        self.holes[id(hole)] = offset
        self.segments.append((self.start, bytes(self.out)))
        self.out = bytearray()
        self.start = offset + hole.nbytes


def _batches(items: list) -> Iterator[list]:
    """Items in runs of 1000, as Python's pickler writes APPENDS and SETITEMS."""
    for start in range(0, max(len(items), 1), 1000):
        chunk = items[start:start + 1000]
        if chunk:
            yield chunk
