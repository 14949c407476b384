"""Reading a folder of safetensors files: the source side of both safetensors formats.

* Hugging Face (``safetensors``): ``model.safetensors``, or ``model-00001-of-00003.safetensors``
  ... with a ``model.safetensors.index.json`` whose ``weight_map`` says which file holds each
  key. Every tensor is whole: global offset zeros, global shape its shape.
* Sharded (``dcp-safetensors``), the way PyTorch DCP's Hugging Face storage writes it: each
  file's metadata key ``DCP_SHARDING_INFO`` holds JSON ``{key: {"saved_offsets": [...]}}``,
  the global offset of that file's chunk of ``key``. Chunks of one key may lie in several
  files; the global shape is where the furthest chunk ends on each axis.

One reader serves both: a folder may hold either, DCP's writer adds an index too, and the
checks are the same. The source says ``dcp-safetensors`` when any file carries sharding info.

Files numbered as a set (``model-00002-of-00003``, ``rank-00001-of-00002``) are read only as
a whole set: a folder missing one of them (a copy or a conversion that did not finish) is
refused, since the chunks that are there would describe smaller tensors, or fewer, without
a word.
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from aoa.errors import StorageError, quote
from aoa.inputs import load_json
from aoa.layout import ShardDesc
from aoa.limits import MAX_DIMS
from aoa.storage.chunks import Chunk, ChunkColumns, as_stored, shards_by_key, stored_shards
from aoa.storage.compact_header import read_saved_offsets
from aoa.storage.formats import Source, StoredShards
from aoa.storage.hf_index import index_files, read_index
from aoa.storage.safetensors import SafetensorsFile, TensorInfo, interned

if TYPE_CHECKING:  # numpy is imported where a conversion needs it: `aoa check` never does
    import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARDING_KEY = "DCP_SHARDING_INFO"
OFFSETS_KEY = "saved_offsets"

T = TypeVar("T")


class SafetensorsSource(Source[int]):
    """The open files of a safetensors checkpoint; buffers are views of their mappings.

    A shard's location is its row: where its tensor comes among every file's tensors, file
    after file (the files in order, each file's tensors in its order)."""

    def __init__(self, path: Path, files: dict[Path, SafetensorsFile],
                 offsets_read: Sequence[_Offsets | None] = ()) -> None:
        """``offsets_read``: each file's sharding info, where it was read already
        (`_offsets_read_ahead`; None or none given: read here)."""
        sharded = any(SHARDING_KEY in file.metadata for file in files.values())
        self._files = files
        self._listed = list(files.values())
        #: each row's file (its number in ``_listed``), and its tensor's name and bytes there
        self._numbers = _rows(itertools.repeat(number, len(file.columns.names))
                              for number, file in enumerate(self._listed))
        self._names = _rows(file.columns.names for file in self._listed)
        self._offsets = _rows(file.columns.offsets for file in self._listed)
        self._nbytes = _rows(file.columns.nbytes for file in self._listed)
        self._last_plan: tuple[Sequence[ShardDesc], np.ndarray] | None = None
        super().__init__(path, "dcp-safetensors" if sharded else "safetensors",
                         _shards(files, offsets_read))

    def buffer(self, shard: ShardDesc) -> memoryview:
        return self.buffers([shard])[0]

    def buffers(self, shards: Sequence[ShardDesc]) -> list[memoryview]:
        rows = self.locations(shards)
        numbers = list(map(self._numbers.__getitem__, rows))
        first_rows = dict(zip(reversed(numbers), reversed(rows)))  # each file's first asked
        wholes = {number: self._listed[number].whole(self._names[first_rows[number]])
                  for number in dict.fromkeys(numbers)}
        offsets = list(map(self._offsets.__getitem__, rows))
        return list(map(_SLICE_OF, map(wholes.__getitem__, numbers), map(
            slice, offsets, map(operator.add, offsets, map(self._nbytes.__getitem__, rows)))))

    def release(self, shard: ShardDesc) -> None:
        self.release_many([shard])

    def release_many(self, shards: Sequence[ShardDesc]) -> None:
        rows = self.locations(shards)
        numbers = list(map(self._numbers.__getitem__, rows))
        ranges = list(zip(map(self._offsets.__getitem__, rows),
                          map(self._nbytes.__getitem__, rows)))
        if len(set(numbers)) > 1:  # by file, each file's in the order asked
            order = sorted(range(len(rows)), key=numbers.__getitem__)
            numbers = list(map(numbers.__getitem__, order))
            ranges = list(map(ranges.__getitem__, order))
        ends = list(itertools.accumulate(collections.Counter(numbers).values()))
        for number, start, end in zip(dict.fromkeys(numbers), [0, *ends[:-1]], ends):
            self._listed[number].pages.release_many(ranges[start:end])

    def plan_buffers(self, shards: Sequence[ShardDesc]) -> Callable[[list[int]], list[memoryview]]:
        """Rows of ``shards`` looked up once; each call then gathers files and byte ranges
        with numpy, and slices the files' mappings."""
        import numpy as np

        rows = self._plan_rows(shards)
        numbers, offsets, nbytes = self._columns

        def buffers(indices: list[int]) -> list[memoryview]:
            asked = self._asked(rows, shards, indices)
            files = numbers[asked]
            _, firsts = np.unique(files, return_index=True)
            firsts.sort()  # each file's first asked, in the order asked
            wholes = {number: self._listed[number].whole(self._names[row])
                      for number, row in zip(files[firsts].tolist(), asked[firsts].tolist())}
            starts = offsets[asked]
            return list(map(_SLICE_OF, map(wholes.__getitem__, files.tolist()),
                            map(slice, starts.tolist(), (starts + nbytes[asked]).tolist())))

        return buffers

    def plan_windows(self, shards: Sequence[ShardDesc]
                     ) -> Callable[[np.ndarray], tuple[list[memoryview], np.ndarray]]:
        """Rows of ``shards`` looked up once; each call then gathers files and byte ranges
        with numpy: the files' mappings, and each shard's range in its file's."""
        import numpy as np

        rows = self._plan_rows(shards)
        numbers, offsets, nbytes = self._columns

        def windows(indices: np.ndarray) -> tuple[list[memoryview], np.ndarray]:
            asked = self._asked(rows, shards, indices)
            files = numbers[asked]
            used, firsts, buffers = np.unique(files, return_index=True, return_inverse=True)
            order = np.argsort(firsts, kind="stable")  # each file's first asked, as asked
            wholes: list[memoryview | None] = [None] * len(used)
            for slot, number, row in zip(order.tolist(), used[order].tolist(),
                                         asked[firsts[order]].tolist()):
                wholes[slot] = self._listed[number].whole(self._names[row])
            return (cast(list[memoryview], wholes),
                    np.stack([buffers.reshape(-1), offsets[asked], nbytes[asked]], axis=1))

        return windows

    def plan_extents(self, shards: Sequence[ShardDesc]
                     ) -> tuple[list[Path], Callable[[np.ndarray], np.ndarray]]:
        """Rows of ``shards`` looked up once; each call then gathers file numbers and byte
        ranges with numpy."""
        import numpy as np

        rows = self._plan_rows(shards)
        numbers, offsets, nbytes = self._columns

        def extents(indices: np.ndarray) -> np.ndarray:
            asked = self._asked(rows, shards, indices)
            return np.stack([numbers[asked], offsets[asked], nbytes[asked]], axis=1)

        return [file.path for file in self._listed], extents

    def plan_release(self, shards: Sequence[ShardDesc]) -> Callable[[list[int]], None]:
        """Rows of ``shards`` looked up once; each release then drops byte ranges per file
        with numpy, no Python work per shard."""
        import numpy as np

        rows = self._plan_rows(shards)
        numbers, offsets, nbytes = self._columns

        def release(indices: list[int]) -> None:
            asked = self._asked(rows, shards, indices)
            asked = asked[np.argsort(numbers[asked], kind="stable")]  # by file, as asked
            files = numbers[asked]
            cuts = np.flatnonzero(files[1:] != files[:-1]) + 1
            for number, part in zip(files[np.concatenate(([0], cuts))].tolist(),
                                    np.split(asked, cuts)):
                self._listed[number].pages.release_columns(offsets[part], nbytes[part])

        return release

    @functools.cached_property
    def _columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's file number, offset and bytes, as int64 arrays (for plan indices)."""
        import numpy as np

        return (np.array(self._numbers, np.int64), np.array(self._offsets, np.int64),
                np.array(self._nbytes, np.int64))

    def _plan_rows(self, shards: Sequence[ShardDesc]) -> np.ndarray:
        """The row of each shard, -1 where the source holds none (refused when asked); the
        last plan's kept, since its buffers and its releases both ask."""
        import numpy as np

        last = self._last_plan
        if last is not None and last[0] is shards:
            return last[1]
        made = self.made_locations(shards)
        if made is not None:
            rows = np.array(made, np.int64)
        else:
            keys = zip(map(_KEY, shards), map(_GLOBAL_OFFSET, shards))
            rows = np.fromiter(map(self._locations.get, keys, itertools.repeat(-1)), np.int64,
                               count=len(shards))
        self._last_plan = (shards, rows)
        return rows

    def _asked(self, rows: np.ndarray, shards: Sequence[ShardDesc],
               indices: list[int] | np.ndarray) -> np.ndarray:
        """The rows of plan indices ``indices``; a shard the source lacks named as
        `location` names it."""
        import numpy as np

        asked = rows[np.array(indices, np.int64)]
        if len(asked) and asked.min() < 0:
            self.location(shards[indices[int(np.argmin(asked))]])
        return asked

    def file_of(self, shard: ShardDesc) -> Path:
        return self._listed[self._numbers[self.location(shard)]].path

    def files(self) -> list[Path]:
        return sorted(self._files)

    def close(self) -> None:
        for file in self._files.values():
            file.close()

_SLICE_OF = cast(Callable[[memoryview, slice], memoryview], operator.getitem)


_KEY = operator.attrgetter("key")
_GLOBAL_OFFSET = operator.attrgetter("global_offset")


def _rows(columns: Iterable[Iterable[T]]) -> list[T]:
    """Every file's column, file after file: one per row."""
    return list(itertools.chain.from_iterable(columns))


def claims(path: Path) -> bool:
    """A safetensors file, or a folder with an index or safetensors files (sharded or not:
    the source then says which)."""
    if path.is_file():
        return path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json")
    return (path / INDEX_NAME).is_file() or bool(_folder_files(path, required=False))


def is_sharded(path: Path) -> bool:
    """Whether the first safetensors file of ``path`` carries DCP sharding info."""
    names = [path] if path.is_file() else _folder_files(path, required=False)
    if not names or names[0].suffix != ".safetensors":
        return False
    try:
        with SafetensorsFile.open(names[0]) as file:
            return SHARDING_KEY in file.metadata
    except StorageError:
        return False  # the reader will say what is wrong with it


def open_folder(path: Path) -> SafetensorsSource:
    """Open a safetensors file, or a folder of them (Hugging Face or DCP-sharded).

    The files of a folder are those its index names, or else every ``*.safetensors`` in it.
    """
    index = path / INDEX_NAME
    if path.is_file() and path.name.endswith(".index.json"):
        index = path  # an index names its folder's files
    weight_map = None
    if path.is_file() and index != path:
        names = [path]
    elif index.is_file():
        weight_map = read_index(index)
        names = index_files(index, weight_map)
    elif path.is_dir():
        names = _folder_files(path)
        _check_sets(path, names)
    else:
        raise StorageError(f"{path}: no such checkpoint file or folder")
    files: dict[Path, SafetensorsFile] = {}
    try:
        opened = SafetensorsFile.open_all_reading(names, _offsets_read_ahead)
        files.update(zip(names, (file for file, _ in opened)))
        if weight_map is not None:
            _check_index(index, weight_map, files)
        if len(names) == 1 and names[0] == path:
            _check_alone(path, files[path])
        return SafetensorsSource(path, files, [offsets for _, offsets in opened])
    except BaseException:
        for file in files.values():
            file.close()
        raise


def _folder_files(folder: Path, required: bool = True) -> list[Path]:
    names = sorted(
        name
        for name in folder.glob("*.safetensors")
        if name.is_file() and not name.name.startswith(".")
    ) if folder.is_dir() else []
    if not names and required:
        raise StorageError(f"{folder}: no .safetensors files in this folder")
    return names


_NUMBERED = re.compile(r"(?P<stem>.+)-(?P<number>\d+)-of-(?P<count>\d+)\.safetensors")


def _check_sets(folder: Path, names: list[Path]) -> None:
    """Every numbered set of files in ``folder`` complete: ``count`` files numbered from 1
    (Hugging Face) or from 0 (ranks), none missing."""
    sets: dict[tuple[str, str], list[int]] = {}
    for name in names:
        found = _NUMBERED.fullmatch(name.name)
        if found:
            sets.setdefault((found["stem"], found["count"]), []).append(int(found["number"]))
    for (stem, count), numbers in sorted(sets.items()):
        first = 0 if 0 in numbers else 1
        expected = range(first, first + int(count))
        if sorted(numbers) == list(expected):
            continue
        width = len(count)
        missing = [f"{stem}-{n:0{width}d}-of-{count}.safetensors" for n in expected
                   if n not in numbers]
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more"
                                          if len(missing) > 3 else "")
        raise StorageError(
            f"{folder}: holds {len(numbers)} of the {int(count)} files "
            f"{stem}-*-of-{count}.safetensors" + (f"; missing {shown}" if missing else
                                                   ", numbered past the count"),
            hint="A copy or a conversion did not finish: the files that are there do not "
                 "make a whole checkpoint.")


def _check_alone(path: Path, file: SafetensorsFile) -> None:
    """A file given alone is not one rank's chunks of a sharded set: its global shapes
    would be those of the chunks it holds."""
    found = _NUMBERED.fullmatch(path.name)
    if found and int(found["count"]) > 1 and SHARDING_KEY in file.metadata:
        raise StorageError(f"{path}: one of the {int(found['count'])} rank files of a sharded "
                           "checkpoint; its chunks alone do not make the tensors",
                           hint=f"Give the folder: --source {path.parent}")


def _check_index(
    index: Path, weight_map: dict[str, str], files: dict[Path, SafetensorsFile]
) -> None:
    """Each key the index names is in the file it names, and each key stored is named.

    (DCP maps a key split over several files to one of them; that passes both checks.)
    """
    held = {path: set(file.columns.names) for path, file in files.items()}
    for key, name in weight_map.items():
        if key not in held[index.parent / name]:
            raise StorageError(
                f"{index}: says tensor '{key}' is in '{name}', which does not hold it"
            )
    for file in files.values():
        if weight_map.keys() >= held[file.path]:
            continue
        for key in file.columns.names:
            if key not in weight_map:
                raise StorageError(f"{file.path}: tensor '{key}' is not in the index {index}")


def _shards(files: dict[Path, SafetensorsFile], offsets_read: Sequence[_Offsets | None] = ()
            ) -> StoredShards:
    """Every stored chunk, grouped by key, with global shapes and the checks between chunks;
    each located by its row (every file's tensors, file after file). ``offsets_read``: as
    `SafetensorsSource` takes them."""
    listed = [(file, read or _sharding_info(file)) for file, read in zip(
        files.values(), itertools.chain(offsets_read, itertools.repeat(None)))]
    return _shards_in_bulk(listed) or _shards_key_by_key(listed)


#: Keys of a file's sharding info, and each one's global offset (two columns).
_Offsets = tuple[Sequence[str], list[tuple[int, ...]]]


def _shards_in_bulk(listed: list[tuple[SafetensorsFile, _Offsets]]) -> StoredShards | None:
    """`_shards`, every file's chunks as columns (`stored_shards`); None where a key lies in
    several files and some file has no offset for one of its tensors (then the chunks are
    read key by key, which names such a key)."""
    keys = _rows(file.columns.names for file, _ in listed)
    offsets: list[tuple[int, ...]] = []
    partial = False
    for file, (found, saved) in listed:
        names = file.columns.names
        if found == names:  # listed as the header lists them, as DCP writes them
            offsets += saved
        elif len(found) == len(names):  # (distinct keys the file holds: each of its names)
            offsets += map(dict(zip(found, saved)).__getitem__, names)
        else:  # a tensor without an offset is whole
            partial = True
            offsets += map(dict(zip(found, saved)).get, names,
                           map(_ZEROS.__getitem__, map(len, file.columns.shapes)))
    if partial and len(set(keys)) < len(keys):
        return None
    # the reader has checked every name, shape, dtype and offset (typed)
    return stored_shards(ChunkColumns(
        keys, _rows(file.columns.shapes for file, _ in listed), offsets,
        _rows(file.columns.dtypes for file, _ in listed),
        _rows(itertools.repeat(file.path, len(file.columns.names)) for file, _ in listed),
        range(len(keys))), typed=True)


_ZEROS = tuple((0,) * rank for rank in range(MAX_DIMS + 1))  # a header's tensor has <= 64


def _shards_key_by_key(listed: list[tuple[SafetensorsFile, _Offsets]]) -> StoredShards:
    """`_shards`, the chunks gathered key by key."""
    found: dict[str, list[tuple[SafetensorsFile, tuple[int, ...] | None, TensorInfo, int]]] = {}
    rows = itertools.count()
    for file, columns in listed:
        offsets = dict(zip(*columns))
        for key, info in file.tensors.items():
            found.setdefault(key, []).append((file, offsets.get(key), info, next(rows)))
    chunks: dict[str, list[Chunk]] = {}
    for key, stored in found.items():
        if len(stored) > 1 and any(offset is None for _, offset, _, _ in stored):
            shards_by_key(chunks)  # the keys before it first, as they are listed
            files_named = ", ".join(str(file.path) for file, _, _, _ in stored)
            raise StorageError(
                f"tensor '{key}' is stored in several files without {SHARDING_KEY}: "
                f"{files_named}")
        chunks[key] = [Chunk(info.shape, offset or (0,) * len(info.shape), info.dtype,
                             file.path, row)
                       for file, offset, info, row in stored]
    return as_stored(shards_by_key(chunks))


def _sharding_info(file: SafetensorsFile) -> _Offsets:
    """The keys of ``file``'s DCP metadata and the global offset of each one's chunk (none
    if no metadata), as columns: sharding info listing the header's names (as DCP writes
    it) needs no dict, only its offsets in their order."""
    text = file.metadata.get(SHARDING_KEY)
    if text is None:
        return [], []
    found = _offsets_in_written_form(text, file)
    if found is not None:
        return found
    where = f"{file.path}: {SHARDING_KEY}"
    info = load_json(text, where, StorageError)
    offsets = _well_formed_offsets(info, file) or _offsets_entry_by_entry(info, file, where)
    return list(offsets), list(offsets.values())


def _offsets_read_ahead(file: SafetensorsFile) -> _Offsets | None:
    """`_sharding_info` of ``file`` where it is in the form DCP writes, read where its header
    is read (`SafetensorsFile.open_all_reading`: the later half of a folder's files in a
    child); None where there is none or it is in another form (`_sharding_info` then reads
    it when the files are all open, so its faults come after every header's)."""
    text = file.metadata.get(SHARDING_KEY)
    return None if text is None else _offsets_in_written_form(text, file)


def _offsets_in_written_form(text: str, file: SafetensorsFile) -> _Offsets | None:
    """`_well_formed_offsets` of sharding info in `json.dumps`'s form, as columns, read
    without a JSON parser (`read_saved_offsets`); None where it is not in that form or has
    a fault."""
    found = read_saved_offsets(text, file.columns.names)
    if found is None:
        return None
    keys, saved = found
    ranks = _ranks(keys, file)
    if ranks is None or list(map(len, saved)) != ranks:
        return None
    return keys, saved


def _ranks(keys: Sequence[str], file: SafetensorsFile) -> list[int] | None:
    """The rank of each of ``keys`` in ``file``; None if the file does not hold one."""
    names, shapes = file.columns.names, file.columns.shapes
    if keys == names:  # listed as the header lists them (as DCP writes them)
        return list(map(len, shapes))
    rank_of = dict(zip(names, map(len, shapes)))
    if not rank_of.keys() >= set(keys):
        return None
    return list(map(rank_of.__getitem__, keys))


_SAVED_OFFSETS = operator.itemgetter(OFFSETS_KEY)
_INT_ONLY = frozenset({int})
_LIST_ONLY = frozenset({list})
_DICT_ONLY = frozenset({dict})


def _well_formed_offsets(info: object, file: SafetensorsFile
                         ) -> dict[str, tuple[int, ...]] | None:
    """What `_offsets_entry_by_entry` returns, where it finds no fault, made column by
    column; None at the first doubt (or for no entries), for it to name the fault."""
    if type(info) is not dict or not info:
        return None
    ranks = _ranks(list(info), file)
    if ranks is None:
        return None
    entries = list(info.values())
    if not _DICT_ONLY.issuperset(map(type, entries)):
        return None
    try:
        saved = list(map(_SAVED_OFFSETS, entries))
    except KeyError:
        return None
    if not (_LIST_ONLY.issuperset(map(type, saved)) and list(map(len, saved)) == ranks):
        return None
    numbers = list(itertools.chain.from_iterable(saved))
    if not _INT_ONLY.issuperset(map(type, numbers)) or min(numbers, default=0) < 0:
        return None
    return dict(zip(info, interned(list(map(tuple, saved)))))


def _offsets_entry_by_entry(info: object, file: SafetensorsFile, where: str
                            ) -> dict[str, tuple[int, ...]]:
    """Global offset of each chunk in ``file`` from its parsed sharding info, each entry
    checked in turn: the first fault is a StorageError naming the tensor."""
    if not isinstance(info, dict):
        raise StorageError(f"{where} is not an object of key -> saved_offsets")
    offsets: dict[str, tuple[int, ...]] = {}
    for key, entry in info.items():
        if key not in file.tensors:
            raise StorageError(f"{where} names tensor '{key}', which the file does not hold")
        saved = entry.get(OFFSETS_KEY) if isinstance(entry, dict) else None
        ndim = len(file.tensors[key].shape)
        if not (
            isinstance(saved, list)
            and len(saved) == ndim
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in saved)
        ):
            raise StorageError(
                f"{where}: tensor '{key}' has saved_offsets {quote(saved)}, not {ndim} "
                f"non-negative integers"
            )
        offsets[key] = tuple(saved)
    return offsets
