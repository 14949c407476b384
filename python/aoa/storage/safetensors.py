"""One safetensors file: a strict, memory-mapped reader and an in-place writer.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the data section. The reader checks every claim the
header makes before a byte is used, so a kernel never reads past what the file holds.
The writer takes the tensors as `ShardDesc` records (key, local shape, dtype) and knows the
header up front, so it sizes the file once, maps it, and lets the
caller's kernel write each tensor straight into the mapping: no staging copy.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import json.encoder
import math
import mmap
import operator
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from aoa.dtypes import ITEMSIZES, SAFETENSORS_CODES, SAFETENSORS_NAMES, itemsize, numpy_dtype
from aoa.errors import StorageError, quote
from aoa.inputs import decode, load_json
from aoa.layout import ShardDesc, shard_kinds
from aoa.limits import MAX_BYTES, MAX_DIMS, shape_problem
from aoa.storage.compact_header import read_compact_header
from aoa.storage.formats import FileLayout, ShardSpans
from aoa.storage.in_place import InPlaceWriter
from aoa.storage.pages import PageRelease

if TYPE_CHECKING:  # reading headers and mapping files needs no numpy: imported when used
    import numpy as np

#: The reference implementation refuses headers larger than this, and so do we.
MAX_HEADER_BYTES = 100_000_000

_LENGTH_BYTES = 8
_METADATA_KEY = "__metadata__"
_ENTRY_FIELDS = frozenset({"dtype", "shape", "data_offsets"})

T = TypeVar("T")


class TensorInfo(NamedTuple):
    """A tensor as stored in one file: ``offset`` is where its bytes start inside the file.
    (The writer takes `ShardDesc` records: a tensor is written under its key, with its
    local shape and dtype.) A named tuple: a header makes tens of thousands of them."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class TensorColumns(NamedTuple):
    """A file's tensors as columns, in file order (each one's name, dtype, shape, where its
    bytes start inside the file and how many): what a header of 30k entries is read into,
    with no record per tensor until one is asked for (`SafetensorsFile.tensors`)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    nbytes: list[int]


class SafetensorsFile:
    """A safetensors file mapped read-only; buffers and arrays are views of the mapping."""

    def __init__(
        self,
        path: Path,
        mapping: mmap.mmap,
        metadata: dict[str, str],
        columns: TensorColumns,
    ) -> None:
        self.path = path
        self.metadata = metadata
        #: the tensors, in file order
        self.columns = columns
        self._tensors: dict[str, TensorInfo] | None = None
        self._mapping: mmap.mmap | None = mapping
        #: drops the pages of bytes read once (`release`), in batches
        self.pages = PageRelease(mapping)

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """Each tensor by name, in file order (made when first asked for)."""
        if self._tensors is None:
            self._tensors = dict(zip(self.columns.names, map(
                _new_tuple, itertools.repeat(TensorInfo), zip(*self.columns))))
        return self._tensors

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SafetensorsFile:
        """Map ``path`` and validate its header; raises StorageError naming what is wrong."""
        path = Path(path)
        return cls._parsed(path, _mapped(path))

    @classmethod
    def open_all(cls, paths: Sequence[Path]) -> list[SafetensorsFile]:
        """`open` of each path, in order, with `open`'s errors (the first file at fault
        raises; none is left open). The later half's headers are read meanwhile in a forked
        child (`aoa.forked`), over the mappings made here: a rank file's header of 30k
        entries takes ~70 ms, a core's work. A header the child could not read is read
        here, which says what is wrong with it."""
        return [file for file, _ in cls.open_all_reading(paths, None)]

    @classmethod
    def open_all_reading(cls, paths: Sequence[Path],
                         reading: Callable[[SafetensorsFile], T | None] | None
                         ) -> list[tuple[SafetensorsFile, T | None]]:
        """`open_all`, each file with ``reading`` of it, made where its header was read:
        the later half's in the child, so that more of each file's own work is done two at a
        time (a rank's sharding info, ~17 ms each). ``reading`` never raises: None where it
        cannot tell (the caller then does that work itself, which says what is wrong)."""
        from aoa.forked import WORTH_A_CHILD_BYTES, forked

        later = list(paths[(len(paths) + 1) // 2:])
        mapped: list[mmap.mmap | StorageError] = []
        for path in later:  # (a fault is raised in the paths' order, below)
            try:
                mapped.append(_mapped(path))
            except StorageError as error:
                mapped.append(error)
        opened: list[tuple[SafetensorsFile, T | None]] = []
        try:
            with forked(functools.partial(_parse_all, later, mapped, reading)
                        if _header_bytes(mapped) >= WORTH_A_CHILD_BYTES else None) as pending:
                for path in paths[:len(paths) - len(later)]:
                    file = cls.open(path)
                    opened.append((file, _read_by(reading, file)))
                parsed = pending.result() if pending is not None else None
            for path, mapping, found in zip(later, mapped,
                                            parsed or itertools.repeat(None)):
                if isinstance(mapping, StorageError):
                    raise mapping
                if found is None:
                    file = cls._parsed(path, mapping)
                    opened.append((file, _read_by(reading, file)))
                else:
                    metadata, columns, read = found
                    opened.append((cls(path, mapping, metadata, columns), read))
        except BaseException:
            for file, _ in opened:
                file.close()
            taken = max(0, len(opened) - (len(paths) - len(later)))  # later ones opened
            for mapping in mapped[taken:]:
                if not isinstance(mapping, StorageError):
                    mapping.close()
            raise
        return opened

    @classmethod
    def _parsed(cls, path: Path, mapping: mmap.mmap) -> SafetensorsFile:
        """A file of the mapping of ``path``, its header read here; the mapping closed if
        the header is refused."""
        try:
            metadata, columns = _parse(path, mapping)
        except BaseException:
            mapping.close()
            raise
        return cls(path, mapping, metadata, columns)

    def buffer(self, name: str) -> memoryview:
        """The bytes of tensor ``name``: a read-only slice of the mapping, no copy."""
        info = self._info(name)
        return self.whole(name)[info.offset : info.offset + info.nbytes]

    def whole(self, reading: str) -> memoryview:
        """The whole file as mapped, read-only, to slice tensors from (``reading``: the
        tensor wanted, named if the file is closed)."""
        if self._mapping is None:
            raise StorageError(f"{self.path}: closed; cannot read tensor '{reading}'")
        return memoryview(self._mapping)

    def buffers(self, names: list[str]) -> list[memoryview]:
        """`buffer` of each name, sliced from one view of the mapping."""
        infos = self._infos(names)
        whole = self.whole(names[0])
        offsets = list(map(_OFFSET, infos))
        return list(map(whole.__getitem__, map(slice, offsets, map(
            operator.add, offsets, map(_NBYTES, infos)))))

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a read-only numpy view (bf16 and fp8 through ml_dtypes)."""
        import numpy as np

        info = self._info(name)
        return np.frombuffer(self.buffer(name), dtype=numpy_dtype(info.dtype)).reshape(info.shape)

    def release(self, name: str) -> None:
        """Drop tensor ``name``'s pages from this process's memory (they stay in the page
        cache, and come back on the next read): keeps a long conversion's resident size
        near what it is writing, not everything it has read. In batches (`PageRelease`)."""
        info = self._info(name)
        self.pages.release(info.offset, info.nbytes)

    def close(self) -> None:
        """Unmap the file. Views still held elsewhere keep the mapping alive until they go."""
        self.pages.close()
        if self._mapping is not None:
            _unmap(self._mapping)
            self._mapping = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _infos(self, names: list[str]) -> list[TensorInfo]:
        tensors = self.tensors
        try:
            return [tensors[name] for name in names]
        except KeyError as missing:
            raise StorageError(f"{self.path}: no tensor '{missing.args[0]}'") from None

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise StorageError(f"{self.path}: no tensor '{name}'") from None


def _mapped(path: Path) -> mmap.mmap:
    """``path`` mapped read-only; a StorageError where it cannot be."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < _LENGTH_BYTES:
                raise StorageError(
                    f"{path}: truncated: {size} bytes, too short for the 8-byte header length"
                )
            return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as error:
        raise StorageError(f"{path}: cannot open: {error.strerror}") from error


def _header_bytes(mapped: Sequence[mmap.mmap | StorageError]) -> int:
    """The header bytes the mapped files say they have (as much as the mappings hold)."""
    return sum(min(struct.unpack("<Q", mapping[:_LENGTH_BYTES])[0], len(mapping))
               for mapping in mapped if not isinstance(mapping, StorageError))


def _parse_all(paths: Sequence[Path], mapped: Sequence[mmap.mmap | StorageError],
               reading: Callable[[SafetensorsFile], T | None] | None
               ) -> list[tuple[dict[str, str], TensorColumns, T | None] | None]:
    """`_parse` of each mapped file, with ``reading`` of the file it makes; None for one
    that is not mapped or is refused (read again where it is opened, which raises its error
    there)."""
    found: list[tuple[dict[str, str], TensorColumns, T | None] | None] = []
    for path, mapping in zip(paths, mapped):
        try:
            if isinstance(mapping, StorageError):
                found.append(None)
                continue
            metadata, columns = _parse(path, mapping)
        except StorageError:
            found.append(None)
            continue
        found.append((metadata, columns,
                      _read_by(reading, SafetensorsFile(path, mapping, metadata, columns))))
    return found


def _read_by(reading: Callable[[SafetensorsFile], T | None] | None, file: SafetensorsFile
             ) -> T | None:
    return None if reading is None else reading(file)


_OFFSET = operator.attrgetter("offset")
_NBYTES = operator.attrgetter("nbytes")


def _parse(path: Path, data: mmap.mmap) -> tuple[dict[str, str], TensorColumns]:
    """Metadata and tensors (in file order) of a mapped file, every claim checked."""
    (header_bytes,) = struct.unpack("<Q", data[:_LENGTH_BYTES])
    implausible = header_bytes > MAX_HEADER_BYTES or _LENGTH_BYTES + header_bytes > len(data)
    if implausible and data[_LENGTH_BYTES:_LENGTH_BYTES + 1] != b"{":
        raise StorageError(f"{path}: not a safetensors file: {_looks_like(data[:16])}",
                           hint="aoa reads safetensors files: an 8-byte header length, then "
                                "a JSON header starting with '{'.")
    if header_bytes > MAX_HEADER_BYTES:
        raise StorageError(
            f"{path}: header of {header_bytes} bytes is over the limit of {MAX_HEADER_BYTES}"
        )
    if _LENGTH_BYTES + header_bytes > len(data):
        raise StorageError(
            f"{path}: truncated: header length {header_bytes} runs past the end of the file "
            f"({len(data)} bytes)"
        )
    text = decode(data[_LENGTH_BYTES : _LENGTH_BYTES + header_bytes], path, "header",
                  StorageError)
    data_start = _LENGTH_BYTES + header_bytes
    found = _read_well_formed(text, data_start, len(data) - data_start)
    if found is not None:
        return found
    metadata, tensors = _read_entry_by_entry(path, text, data_start, len(data) - data_start)
    return metadata, TensorColumns(*(map(list, zip(*tensors.values())) if tensors else
                                     ([] for _ in TensorColumns._fields)))


_INT_ONLY = frozenset({int})
_STR_ONLY = frozenset({str})
_LIST_ONLY = frozenset({list})
_TUPLE_ONLY = frozenset({tuple})
_ITEMSIZE_OF_CODE = {code: itemsize(dtype) for code, dtype in SAFETENSORS_CODES.items()}


def _read_well_formed(text: str, data_start: int, data_bytes: int
                      ) -> tuple[dict[str, str], TensorColumns] | None:
    """What `_read_entry_by_entry` returns (as columns), for a header that passes all of
    its checks, made column by column (every entry's dtype, then every shape, ...) with no
    Python call per entry: the checks of a header of 31k entries take a fraction of the
    time parsing its JSON takes. None at the first doubt; the entry-by-entry reading then finds the
    fault and names it.

    JSON objects are read as tuples of pairs, so that a key named twice in one object
    shows as a dict shorter than its pairs; arrays stay lists. A header in the compact form
    the safetensors library writes is cut into columns with no JSON parser
    (`read_compact_header`)."""
    compact = read_compact_header(text)
    if compact is not None:
        stored, keys, kind_codes, boxes, begins, ends = compact
        if (not _ITEMSIZE_OF_CODE.keys() >= set(kind_codes)
                or max(map(len, boxes), default=0) > MAX_DIMS):
            return None
        return _in_byte_order(stored, keys, kind_codes, boxes, begins, ends, data_start,
                              data_bytes)
    try:
        pairs = load_json(text, "header", StorageError, object_pairs_hook=tuple)
    except StorageError:
        return None
    if type(pairs) is not tuple:
        return None
    header = dict(pairs)
    if len(header) != len(pairs):
        return None
    stored_metadata = header.pop(_METADATA_KEY, None)
    metadata: dict[str, str] = {}
    if stored_metadata is not None:
        if type(stored_metadata) is not tuple:
            return None
        metadata = dict(stored_metadata)
        if len(metadata) != len(stored_metadata) or not _STR_ONLY.issuperset(
                map(type, metadata.values())):
            return None
    names = list(header)
    columns = _entry_columns(list(header.values()))
    if columns is None:
        return None
    codes, shapes, offsets = columns
    if not _STR_ONLY.issuperset(map(type, codes)):
        return None
    kinds = set(codes)
    if not (_ITEMSIZE_OF_CODE.keys() >= kinds and _LIST_ONLY.issuperset(map(type, shapes))
            and _LIST_ONLY.issuperset(map(type, offsets)) and {2}.issuperset(map(len, offsets))):
        return None
    extents = list(itertools.chain.from_iterable(shapes))
    bounds = list(itertools.chain.from_iterable(offsets))
    if not (_INT_ONLY.issuperset(map(type, extents)) and _INT_ONLY.issuperset(map(type, bounds))
            and min(extents, default=0) >= 0 and min(bounds, default=0) >= 0
            and max(map(len, shapes), default=0) <= MAX_DIMS):
        return None
    return _in_byte_order(metadata, names, codes, list(interned(list(map(tuple, shapes)))),
                          bounds[0::2], bounds[1::2], data_start, data_bytes)


def _in_byte_order(metadata: dict[str, str], names: list[str], codes: Sequence[str],
                   shapes: list[tuple[int, ...]], begins: list[int], ends: list[int],
                   data_start: int, data_bytes: int
                   ) -> tuple[dict[str, str], TensorColumns] | None:
    """The columns of well-typed entries (known dtype codes, extents and offsets that are
    ints >= 0; equal shapes one object, `interned`), in the order of their bytes, if each
    entry's range holds its shape and the ranges tile the data back to back; None at the
    first doubt."""
    kinds = set(codes)
    # each distinct shape's element count once (a header's 30k shapes are a few dozen)
    elements = {shape: math.prod(shape) for shape in dict.fromkeys(shapes)}
    if len(kinds) == 1:  # (one dtype: its size in the counts)
        size = _ITEMSIZE_OF_CODE[next(iter(kinds))]
        sized = {shape: count * size for shape, count in elements.items()}
        needed = list(map(sized.__getitem__, shapes))
    else:
        needed = list(map(operator.mul, map(elements.__getitem__, shapes),
                          map(_ITEMSIZE_OF_CODE.__getitem__, codes)))
    back_to_back = begins == [0, *ends[:-1]]  # as writers list them
    # each range holds its shape: back to back, where each ends at the sum of those so far
    if (ends != list(itertools.accumulate(needed)) if back_to_back else
            list(map(operator.sub, ends, begins)) != needed) or max(ends, default=0) > data_bytes:
        return None
    if 0 in needed and any(shape_problem(shape, _ITEMSIZE_OF_CODE[code]) is not None
                           for shape, code, nbytes in zip(shapes, codes, needed) if not nbytes):
        return None  # holding nothing, a shape may still count past int64 (see shape_problem)
    if not back_to_back:  # put in order of their bytes
        order = sorted(range(len(names)), key=list(zip(begins, ends)).__getitem__)
        names, codes, shapes, begins, ends, needed = (
            _taken(column, order) for column in (names, codes, shapes, begins, ends, needed))
        if begins != [0, *ends[:-1]]:
            return None  # a gap or an overlap
    if (ends[-1] if ends else 0) != data_bytes:
        return None  # bytes after the last tensor
    # (listed back to back, each entry's range begins where the one before ends: that is
    # the order of `_read_entry_by_entry`, sorted by (begin, end), and stable)
    dtypes = ([SAFETENSORS_CODES[codes[0]]] * len(codes) if len(kinds) == 1 else
              list(map(SAFETENSORS_CODES.__getitem__, codes)))
    return metadata, TensorColumns(
        names, dtypes, shapes, list(map(operator.add, begins, itertools.repeat(data_start))),
        needed)


def _taken(column: Sequence[Any], order: list[int]) -> list[Any]:
    return list(map(column.__getitem__, order))


_new_tuple = tuple.__new__  # a named tuple made from a row with no Python call


def interned(boxes: list[tuple[int, ...]]) -> map[tuple[int, ...]]:
    """``boxes`` with equal ones the same object: a header's 30k shapes are a few dozen
    (less memory, and fewer objects for the cyclic collector to visit)."""
    first: dict[tuple[int, ...], tuple[int, ...]] = {}
    return map(first.setdefault, boxes, boxes)


def _entry_columns(entries: list[Any]) -> tuple[Sequence[Any], Sequence[Any], Sequence[Any]] | None:
    """Each entry's dtype, shape and data offsets as three columns, where every entry is an
    object (a tuple of pairs) of exactly these three fields; None where one is not."""
    if not (_TUPLE_ONLY.issuperset(map(type, entries)) and {3}.issuperset(map(len, entries))):
        return None
    if not entries:
        return (), (), ()
    fields = list(zip(*entries))  # every entry's first pair, its second, its third
    names = [set(map(_FIRST, pairs)) for pairs in fields]
    if {1}.issuperset(map(len, names)):  # each field in the same place in every entry
        order = [name for (name,) in names]
        if frozenset(order) != _ENTRY_FIELDS:
            return None
        columns = dict(zip(order, (tuple(map(_SECOND, pairs)) for pairs in fields)))
        return columns["dtype"], columns["shape"], columns["data_offsets"]
    by_name = list(map(dict, entries))
    if not {3}.issuperset(map(len, by_name)):
        return None
    try:
        return (list(map(_DTYPE_FIELD, by_name)), list(map(_SHAPE_FIELD, by_name)),
                list(map(_OFFSETS_FIELD, by_name)))
    except KeyError:
        return None


_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_DTYPE_FIELD = operator.itemgetter("dtype")
_SHAPE_FIELD = operator.itemgetter("shape")
_OFFSETS_FIELD = operator.itemgetter("data_offsets")


def _read_entry_by_entry(path: Path, text: str, data_start: int, data_bytes: int
                         ) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """Metadata and tensors of the header ``text``, each entry checked in turn: the first
    fault is a StorageError naming the file and the tensor."""
    header = load_json(text, f"{path}: header", StorageError, object_pairs_hook=_unique_keys)
    if not isinstance(header, dict):
        raise StorageError(f"{path}: header is not a JSON object")

    metadata = _parse_metadata(path, header.pop(_METADATA_KEY, None))
    ranges = sorted(
        (_parse_entry(path, name, entry, data_bytes) for name, entry in header.items()),
        key=lambda item: (item[1], item[2]),
    )
    end = 0
    for name, begin, stop, _, _ in ranges:
        if begin > end:
            raise StorageError(
                f"{path}: tensor '{name}' starts at data offset {begin}, leaving a gap after "
                f"byte {end}"
            )
        if begin < end:
            raise StorageError(
                f"{path}: tensor '{name}' starts at data offset {begin}, overlapping the tensor "
                f"that ends at {end}"
            )
        end = stop
    if end != data_bytes:
        raise StorageError(
            f"{path}: tensors end at data offset {end} but the data section holds "
            f"{data_bytes} bytes"
        )
    tensors = {
        name: TensorInfo(name, dtype, shape, data_start + begin, stop - begin)
        for name, begin, stop, dtype, shape in ranges
    }
    return metadata, tensors


def _looks_like(head: bytes) -> str:
    """What a file that is not safetensors seems to be, from its first bytes."""
    if head.startswith(b"PK\x03\x04"):
        return "it is a zip archive (a PyTorch .bin or .pt file?)"
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "it is a Python pickle (a PyTorch .bin file of an old format?)"
    if head.lstrip()[:1] in (b"{", b"["):
        return "it is JSON text (an index? give the checkpoint's folder)"
    length = int.from_bytes(head[:_LENGTH_BYTES], "little")
    return (f"its first 8 bytes, read as the header length, say {length} bytes, and no JSON "
            f"header follows (it starts {head!r})")


def _parse_metadata(path: Path, metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        raise StorageError(f"{path}: __metadata__ is not an object of strings to strings")
    return metadata


def _parse_entry(
    path: Path, name: str, entry: Any, data_bytes: int
) -> tuple[str, int, int, str, tuple[int, ...]]:
    """(name, begin, end, dtype, shape) of one header entry, checked against the data size."""
    where = f"{path}: tensor {quote(name)}"
    if not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS:
        raise StorageError(f"{where}: entry must have exactly dtype, shape and data_offsets")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(code, str) or code not in SAFETENSORS_CODES:
        known = " ".join(SAFETENSORS_CODES)
        raise StorageError(f"{where}: unknown dtype {quote(code)} (known: {known})")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise StorageError(f"{where}: shape {quote(shape)} is not a list of non-negative "
                           "integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise StorageError(f"{where}: data_offsets {quote(offsets)} is not [begin, end]")
    dtype = SAFETENSORS_CODES[code]
    problem = shape_problem(tuple(shape), itemsize(dtype))
    if problem is not None:
        raise StorageError(f"{where}: shape {quote(shape)} {problem}")
    begin, end = offsets
    if begin > end:
        raise StorageError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
    if end > data_bytes:
        raise StorageError(
            f"{where}: truncated: data_offsets [{begin}, {end}] run past the end of the data "
            f"section ({data_bytes} bytes)"
        )
    expected = math.prod(shape) * itemsize(dtype)
    if end - begin != expected:
        raise StorageError(
            f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but {code} "
            f"{shape} needs {expected}"
        )
    return name, begin, end, dtype, tuple(shape)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object that names no key twice (json.loads would keep the last silently)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {quote(key)} appears twice")
        result[key] = value
    return result


def _unmap(mapping: mmap.mmap) -> None:
    """Close ``mapping`` unless views of it are still alive; then the last view unmaps it."""
    with contextlib.suppress(BufferError):
        mapping.close()


def header_bytes(tensors: Sequence[ShardDesc], metadata: dict[str, str] | None) -> bytes:
    """Length prefix and JSON header for ``tensors`` stored back to back in the given order,
    padded with spaces to a multiple of 8 bytes as the reference implementation does."""
    made = header_texts(tensors)
    entries = made[0] if made is not None else _entries(tensors, list(map(_KEY, tensors)))
    return _header(entries, _metadata_text(metadata))


class HeaderEntries(NamedTuple):
    """What a safetensors header says of its tensors: the entries' text (UTF-8, between the
    braces, after the metadata), and each tensor's bytes and item size (int64 columns)."""

    text: bytes
    sizes: np.ndarray
    itemsizes: np.ndarray


#: Each dtype safetensors stores: its code and item size (`header_texts`' table).
_CODES_AND_SIZES = {dtype: (code, ITEMSIZES[dtype]) for dtype, code in SAFETENSORS_NAMES.items()}


def header_texts(tensors: Sequence[ShardDesc],
                 sharding: tuple[str, str, str, str] | None = None
                 ) -> tuple[HeaderEntries, bytes | None] | None:
    """The `HeaderEntries` of ``tensors``, unchecked, made in one native pass
    (`aoa._core.header_texts`); with ``sharding`` (a quote's text, the offsets' key, an
    opening and a closing text), also DCP's sharding info between its braces, each quote
    written so, between the opening and the closing, as UTF-8. None where a tensor is not
    plain (a key other than printable ASCII without quote or backslash, a dtype safetensors
    has no code for, sizes past int64): `_entries` and the checks read those."""
    from aoa import _core

    made = _core.header_texts(tensors, _CODES_AND_SIZES, sharding)
    if made is None:
        return None
    text, sizes, itemsizes, info = made
    return HeaderEntries(text, sizes, itemsizes), info


def header_entries(path: Path, tensors: Sequence[ShardDesc], keys: list[str],
                   made: HeaderEntries | None = None) -> HeaderEntries:
    """The `HeaderEntries` of the file ``path`` holding ``tensors`` (``keys``), checked: keys
    once each, none reserved, dtypes safetensors has. ``made``: their entries as
    `header_texts` made them, where the caller has them."""
    if made is None:
        native = header_texts(tensors)
        made = None if native is None else native[0]
    if made is not None:  # (its dtypes are safetensors' own)
        _check_specs(path, tensors, keys)
        entries = made
    else:
        kinds = shard_kinds(tensors)
        _check_specs(path, tensors, keys, kinds[1])
        entries = _entries(tensors, keys, kinds=kinds)
    total = sum(entries.sizes.tolist())  # exact: the int64 offsets wrap past MAX_BYTES
    if total > MAX_BYTES:
        raise StorageError(f"{path}: its tensors hold {total} bytes, more than a file can "
                           f"({MAX_BYTES})")
    return entries


def _entries(tensors: Sequence[ShardDesc], keys: list[str], *,
             kinds: tuple[list[int], dict[int, tuple[str | None, tuple[int, ...]]]] | None = None
             ) -> HeaderEntries:
    """`header_entries`, unchecked, where `header_texts` makes none. The text is what
    ``json.dumps`` makes of the entries (compact separators), put together column by column
    in one join, all that depends only on dtype and shape worked out once per `shard_kinds`
    kind (``kinds``, where the caller has them)."""
    import numpy as np

    key_texts = list(map(json.encoder.encode_basestring, keys))  # type: ignore[attr-defined]
    numbers, kinds_by_number = shard_kinds(tensors) if kinds is None else kinds
    count = len(numbers)
    kind_sizes = np.zeros(max(kinds_by_number, default=-1) + 1, np.int64)
    kind_itemsizes = np.zeros_like(kind_sizes)
    middles = {}
    for number, (dtype, shape) in kinds_by_number.items():
        kind_itemsizes[number] = ITEMSIZES[dtype]  # type: ignore[index]
        kind_sizes[number] = math.prod(shape) * ITEMSIZES[dtype]  # type: ignore[index]
        middles[number] = (f':{{"dtype":"{SAFETENSORS_NAMES[dtype]}",'  # type: ignore[index]
                           f'"shape":[{",".join(map(str, shape))}],"data_offsets":[')
    kind_of = np.fromiter(numbers, np.int64, count)
    sizes = kind_sizes[kind_of]
    if not count:
        return HeaderEntries(b"", sizes, sizes)
    ends = list(map(str, np.cumsum(sizes).tolist()))
    parts = [","] * (6 * count)  # key, middle, begin "," end "]},", entry after entry
    parts[0::6] = key_texts
    parts[1::6] = map(middles.__getitem__, numbers)
    parts[2::6] = ["0", *ends[:-1]]  # each entry begins where the one before ends
    parts[4::6] = ends
    parts[5::6] = itertools.repeat("]},", count)
    parts[-1] = "]}"
    return HeaderEntries("".join(parts).encode("utf-8"), sizes, kind_itemsizes[kind_of])


def _metadata_text(metadata: dict[str, str] | None) -> str | None:
    """The metadata as ``json.dumps`` writes it (compact, not ASCII-escaped); None: none."""
    if not metadata:
        return None
    return json.dumps(metadata, separators=(",", ":"), ensure_ascii=False)


def _header(entries: HeaderEntries, metadata_json: str | None) -> bytes:
    """`header_bytes` of the `HeaderEntries` ``entries`` and the metadata as JSON text
    (None: no metadata): what ``json.dumps`` makes of the header object, in one join."""
    return b"".join(_header_pieces(entries, metadata_json))


def _header_pieces(entries: HeaderEntries, metadata_json: str | bytes | None) -> list[bytes]:
    """`_header` as the pieces it is joined from, in order. A writer copies them into its
    buffers one by one as readily as whole; joined first, a rank file's 7 MB header (30k
    entries) costs one more copy, into fresh memory: 2-3 ms a file."""
    pieces = [b"", b"{"]
    if metadata_json is not None:
        pieces = [b"", f'{{"{_METADATA_KEY}":'.encode(),
                  metadata_json if isinstance(metadata_json, bytes) else metadata_json.encode()]
        if entries.text:
            pieces.append(b",")
    pieces += [entries.text, b"}"]
    length = sum(map(len, pieces))
    padding = b" " * (-length % 8)
    pieces[0] = struct.pack("<Q", length + len(padding))
    pieces.append(padding)
    return pieces


def file_layout(tensors: Sequence[ShardDesc], indices: Sequence[int], path: Path,
                metadata: dict[str, str] | None = None, *, keys: list[str] | None = None,
                metadata_json: str | bytes | None = None, entries: HeaderEntries | None = None
                ) -> FileLayout:
    """A destination's safetensors file: the header, then ``tensors`` (destination shards
    ``indices``) back to back, in this order, each under its key. Where the caller has
    them: ``keys``; ``metadata_json``, the metadata as JSON text or its UTF-8 (then
    ``metadata`` is not read); ``entries``, the tensors' `HeaderEntries`
    (`header_entries`)."""
    import numpy as np

    if keys is None:
        keys = list(map(_KEY, tensors))
    if entries is None:
        entries = header_entries(path, tensors, keys)
    if metadata_json is None:
        _check_metadata(path, metadata)
        metadata_json = _metadata_text(metadata)
    pieces = _header_pieces(entries, metadata_json)
    starts = list(itertools.accumulate(map(len, pieces), initial=0))
    ends = np.cumsum(entries.sizes) + starts[-1]
    return FileLayout(int(ends[-1]) if len(ends) else starts[-1], list(zip(starts, pieces)),
                      ShardSpans(np.fromiter(indices, np.int64, len(indices)),
                                 ends - entries.sizes, entries.sizes, entries.itemsizes))


_KEY = operator.attrgetter("key")


def _check_specs(path: Path, tensors: Sequence[ShardDesc], keys: list[str],
                 kinds: dict[int, tuple[str | None, tuple[int, ...]]] | None = None) -> None:
    """Keys once each, none reserved, dtypes safetensors has (``kinds``: the tensors'
    `shard_kinds`; None: their dtypes are known to be safetensors')."""
    unique = set(keys)
    if (len(unique) < len(keys) or _METADATA_KEY in unique
            or (kinds is not None
                and not SAFETENSORS_NAMES.keys() >= {dtype for dtype, _ in kinds.values()})):
        _check_each_spec(path, tensors)


def _check_metadata(path: Path, metadata: dict[str, str] | None) -> None:
    """Metadata of strings."""
    if metadata is not None and not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        raise StorageError(f"{path}: metadata must map strings to strings")


def _check_each_spec(path: Path, tensors: Sequence[ShardDesc]) -> None:
    """The first tensor whose name or dtype a file cannot hold, named."""
    seen: set[str] = set()
    for spec in tensors:
        where = f"{path}: tensor '{spec.key}'"
        if spec.key == _METADATA_KEY or spec.key in seen:
            raise StorageError(f"{where}: name is reserved or used twice in one file")
        if spec.dtype not in SAFETENSORS_NAMES:
            raise StorageError(f"{where}: dtype {spec.dtype!r} has no safetensors code")
        seen.add(spec.key)


class SafetensorsWriter(InPlaceWriter):
    """One safetensors file written in place (`aoa.storage.in_place`): the header written
    up front, each tensor's bytes filled through :meth:`buffer`, renamed into place by
    :meth:`commit`; a ``with`` block is the unit of atomicity."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        tensors: Sequence[ShardDesc],
        metadata: dict[str, str] | None = None,
    ) -> None:
        path = Path(path)
        keys = list(map(_KEY, tensors))
        entries = header_entries(path, tensors, keys)
        _check_metadata(path, metadata)
        header = _header(entries, _metadata_text(metadata))
        self._ranges: dict[str, tuple[int, int]] = {}
        offset = len(header)
        for key, nbytes in zip(keys, entries.sizes.tolist()):
            self._ranges[key] = (offset, nbytes)
            offset += nbytes
        super().__init__(path, offset)
        self.view(0, len(header))[:] = header

    def buffer(self, name: str) -> memoryview:
        """A writable view of tensor ``name``'s bytes inside the mapped file."""
        if self._mapping is None:
            raise StorageError(f"{self.path}: already finished; cannot write tensor '{name}'")
        try:
            begin, nbytes = self._ranges[name]
        except KeyError:
            raise StorageError(f"{self.path}: no tensor '{name}' in this file") from None
        return self.view(begin, nbytes)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Sequence[ShardDesc],
    metadata: dict[str, str] | None,
    fill: Callable[[dict[str, memoryview]], None],
) -> Path:
    """Write ``tensors`` (in this order, each under its key) to ``path``; ``fill`` gets a
    writable view per tensor and writes the bytes. The file appears under its name only once
    complete."""
    with SafetensorsWriter(path, tensors, metadata) as writer:
        fill({spec.key: writer.buffer(spec.key) for spec in tensors})
        return writer.commit()
