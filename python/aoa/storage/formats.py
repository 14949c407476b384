"""The storage interface: what a checkpoint format gives the runtime and what it takes back.

Every format is one module under `aoa.storage` holding a `FORMAT` record (name, detection,
reader, writer); the runtime and the jobs see only what this module defines.

**Reading.** A `Source` is an open checkpoint: ``shards`` lists each key's stored boxes as
`ShardDesc` records (key, local shape, global shape, global offset, dtype), replicas once,
sorted by global offset and checked to tile the global shape. ``buffer(shard)`` gives the
shard's bytes, C order, read-only: a slice of the file's memory mapping wherever the bytes
lie contiguous in the file (a format that must decode gives a buffer of its own).
``release(shard)`` drops the pages of a shard read once; ``close()`` unmaps. Where a shard's
bytes are (file, byte offset, ...) stays private to the format: it keeps them beside each
`ShardDesc` and finds them by ``(key, global offset)`` through `Source.location`.
``extras()`` names files a format carries over verbatim (Megatron's ``common.pt`` and
``metadata.json``), and ``objects()`` gives the items that are not tensors as their stored
bytes (DCP's bytes items: a step count, Megatron's sharded objects such as the
``_extra_state`` of Transformer Engine layers): a destination of the same family
(``objects_family``) may write both back.

**Writing.** A `Destination` is a whole output checkpoint: the destination shards it will hold
(from the plan) and the files they go in. The job groups shards into ranks (a mesh layout
or a shard list); the format names the files (`plan_files`, a pure function, so a dry run can
print it and ranks can split the files). Then, in one process or spread over ranks:

    with format.destination(folder, shards, files) as destination:
        destination.check()             lock the folder; refuse one holding a checkpoint
        destination.write(fill, files)  fill and finish these files (all, or a rank's share)
        destination.commit()            once, after every file is written: publish them all

A format says only what its files hold: ``layout(file)``, a `FileLayout` (the file's size,
the bytes the format writes itself, such as headers, and where each shard's bytes go), and
``index()``, the small files that make the checkpoint whole (an index, metadata), written
last. The base class does the rest, the same for every format:

* the folder (`aoa.storage.folder`): locked for one conversion at a time (shared by the
  ranks of one, ``check(sharing)``); files written into a hidden staging folder and published
  by ``commit``, data files first and the index last; a failure, an interrupt or a kill
  leaves nothing visible;
* the bytes (`aoa.storage.writer`): ``write`` hands ``fill`` the pieces of a few aligned
  staging buffers at a time (`Piece` records: shard index, buffer, element range) and
  writes each filled one with ``O_DIRECT`` while the next is filled: disk speed, and memory
  that does not grow with the checkpoint. The kernel writes every byte of the pieces it is
  given; bytes of no shard (padding) are zeros.

A format that cannot say its file as a layout overrides ``write_file`` and writes the staged
path its own way.

**A new format** is a module named in `FORMAT_MODULES` whose ``FORMAT`` is a `Format`: a
`Source` subclass (a sharded format builds each key's shards with
`aoa.storage.chunks.key_shards`, or all keys' at once with `shards_by_key`, or from
columns with `stored_shards`, which check replicas and tiling), a `Destination`
subclass (or None for a read-only format) with ``plan_files``, ``layout`` and ``index``, and
a cheap ``claims``. Nothing outside the module changes.

**Formats by name** (`--source-format` / `--output-format`): ``safetensors`` (Hugging Face
folders), ``dcp-safetensors`` (safetensors files with PyTorch DCP's ``DCP_SHARDING_INFO``,
one file per rank), ``paddle`` (FlexCheckpoint ``.distcp``), ``dcp`` (PyTorch DCP),
``torch_dist`` (Megatron-Core), ``bin`` (``pytorch_model.bin``, read only). A name whose
module is not here yet is refused with a `UsageError`. Without a name the format is detected
from the folder's contents: the first format (in the order above) whose ``claims`` says yes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import itertools
import operator
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, NamedTuple, TypeVar, overload

from aoa.collector import collector_paused
from aoa.errors import StorageError, UsageError
from aoa.layout import ShardDesc
from aoa.storage.folder import OutputFolder, Sharing, write_file

if TYPE_CHECKING:  # the command line's help imports this module, and needs no numpy
    import numpy as np

#: Every format name aoa knows, in detection order, and the module that implements it.
FORMAT_MODULES: dict[str, str] = {
    "safetensors": "aoa.storage.huggingface",
    "dcp-safetensors": "aoa.storage.dcp_safetensors",
    "paddle": "aoa.storage.paddle",
    "dcp": "aoa.storage.dcp",
    "torch_dist": "aoa.storage.torch_dist",
    "bin": "aoa.storage.torch_bin",
}
FORMAT_NAMES = tuple(FORMAT_MODULES)

#: Tensor bytes per file of a Hugging Face folder before another file begins (headers not
#: counted, as in Hugging Face's own sharding); a larger tensor gets a file of its own. Here,
#: not in `aoa.storage.huggingface`, so that the command line's help needs no numpy.
DEFAULT_MAX_FILE_BYTES = 5 * 10**9

Location = TypeVar("Location")
_DTYPE = operator.attrgetter("dtype")


class StoredShards(NamedTuple):
    """A source's shards as a format made them in bulk: each key's distinct shards, sorted
    by global offset, and the location of each by (key, global offset). ``made``: where the
    format made every key's shards in one list, that list and each one's location, in order
    (a plan asks for exactly those: their locations need no look-up); then ``locations``
    may be None, made from ``made`` where first asked (`by_place`; a conversion never asks)."""

    shards: dict[str, list[ShardDesc]]
    locations: dict[tuple[str, tuple[int, ...]], Any] | None
    made: tuple[Sequence[ShardDesc], Sequence[Any]] | None = None

    def by_place(self) -> dict[tuple[str, tuple[int, ...]], Any]:
        """Each shard's location by (key, global offset)."""
        if self.locations is not None:
            return self.locations
        assert self.made is not None
        shards, locations = self.made
        return dict(zip(zip(map(_KEY, shards), map(_GLOBAL_OFFSET, shards)), locations))


class Source(ABC, Generic[Location]):
    """An open source checkpoint: its shards by key, and read-only buffers over their bytes.

    A format subclasses it with its own ``Location`` (where a shard's bytes are) and passes
    every shard with its location to ``__init__``: each key's (shard, location) pairs, or
    both as they are kept (`StoredShards`)."""

    def __init__(self, path: Path, format: str,
                 stored: Mapping[str, Sequence[tuple[ShardDesc, Location]]] | StoredShards
                 ) -> None:
        self.path = path
        self.format = format
        if isinstance(stored, StoredShards):
            #: each key's distinct shards, sorted by global offset
            self.shards: dict[str, list[ShardDesc]] = stored.shards
            self._stored = stored
            self._made = stored.made
            return
        self._made = None
        self.shards = {key: [shard for shard, _ in found] for key, found in stored.items()}
        self._stored = StoredShards(self.shards, {
            (shard.key, shard.global_offset): location
            for found in stored.values() for shard, location in found})

    @functools.cached_property
    def _locations(self) -> dict[tuple[str, tuple[int, ...]], Location]:
        """Each shard's location by (key, global offset), made when first asked."""
        return self._stored.by_place()

    def location(self, shard: ShardDesc) -> Location:
        """Where the stored shard of ``shard``'s key at its global offset is."""
        try:
            return self._locations[(shard.key, shard.global_offset)]
        except KeyError:
            raise StorageError(f"{self.path}: holds no shard of '{shard.key}' at global offset "
                               f"{list(shard.global_offset)}") from None

    def locations(self, shards: Sequence[ShardDesc]) -> list[Location]:
        """`location` of each shard (looked up with no Python call per shard)."""
        made = self.made_locations(shards)
        if made is not None:
            return list(made)
        found = list(map(self._locations.get, zip(map(_KEY, shards), map(_GLOBAL_OFFSET,
                                                                          shards))))
        missing = list(map(operator.is_, found, itertools.repeat(None)))  # (no == on them)
        if any(missing):
            self.location(shards[missing.index(True)])  # says which
        return found  # type: ignore[return-value]

    def made_locations(self, shards: Sequence[ShardDesc]) -> Sequence[Location] | None:
        """The locations of ``shards`` where they are the very shards the format made, in
        the order it made them (`StoredShards.made`: a plan's source shards are, at 63k
        shards one identity pass against 17 ms of look-ups); else None (look them up)."""
        made = self._made
        if made is None or len(shards) != len(made[0]) or not all(
                map(operator.is_, shards, made[0])):
            return None
        return made[1]

    @abstractmethod
    def buffer(self, shard: ShardDesc) -> memoryview:
        """The shard's bytes, C order, read-only (a view of the file's mapping where it can)."""

    def buffers(self, shards: Sequence[ShardDesc]) -> list[memoryview]:
        """`buffer` of each shard: what an executor asks a fill's new shards for, at once (a
        format holding many small tensors per file answers in bulk)."""
        return [self.buffer(shard) for shard in shards]

    def release(self, shard: ShardDesc) -> None:
        """Drop the pages of a shard read once from this process's memory (they stay in the
        page cache): keeps a long job's resident size near what it writes."""

    def release_many(self, shards: Sequence[ShardDesc]) -> None:
        """`release` of each shard (in bulk where the format can)."""
        for shard in shards:
            self.release(shard)

    def plan_buffers(self, shards: Sequence[ShardDesc]
                     ) -> Callable[[list[int]], list[memoryview]]:
        """`buffers` of ``shards[i]`` for each index ``i`` it is given: what an executor asks
        a fill's new source shards for (a format may look a plan's shards up once, here)."""
        def buffers(indices: list[int]) -> list[memoryview]:
            return self.buffers([shards[index] for index in indices])

        return buffers

    def plan_windows(self, shards: Sequence[ShardDesc]
                     ) -> Callable[[np.ndarray], tuple[list[memoryview], np.ndarray]] | None:
        """Where the bytes of ``shards[i]`` lie, for the plan indices ``i`` it is given (an
        int64 array): a few buffers (a format's whole files) and a row per index of buffer
        number, byte offset and bytes in it; what an executor asks a fill's source shards
        for where a format can say it. None (the default): the format gives a buffer per
        shard (`plan_buffers`)."""
        return None

    def plan_extents(self, shards: Sequence[ShardDesc]
                     ) -> tuple[list[Path], Callable[[np.ndarray], np.ndarray]] | None:
        """Which file holds the bytes of ``shards[i]``, and where, for the plan indices ``i``
        it is given (an int64 array): the files, and a row per index of file number, byte
        offset and bytes, each shard's bytes as stored there in C order. What reading the
        sources ahead of the fills asks (`aoa.storage.read_ahead`). None (the default): the
        format cannot say, and its sources are read as the fills ask."""
        return None

    def plan_release(self, shards: Sequence[ShardDesc]) -> Callable[[list[int]], None]:
        """A `release_many` of ``shards[i]`` for each index ``i`` it is given: what an
        executor calls after each fill with a plan's source shards (a format may look them
        up once, here, and drop them by columns of ranges)."""
        def release(indices: list[int]) -> None:
            self.release_many([shards[index] for index in indices])

        return release

    @abstractmethod
    def file_of(self, shard: ShardDesc) -> Path:
        """The file that holds the shard's bytes (for messages)."""

    @abstractmethod
    def files(self) -> list[Path]:
        """Every file the source reads, sorted (to name the source's state: sizes, times)."""

    def extras(self) -> dict[str, Path]:
        """Files to carry over verbatim, by name (none for most formats)."""
        return {}

    def objects(self) -> dict[str, bytes]:
        """Items that are not tensors, by key, as the bytes they are stored as (none for most
        formats); never unpickled by aoa."""
        return {}

    def close(self) -> None:
        """Unmap and close the files; buffers still held elsewhere stay valid until dropped."""

    def __enter__(self) -> Source[Location]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_KEY = operator.attrgetter("key")
_GLOBAL_OFFSET = operator.attrgetter("global_offset")


class Piece(NamedTuple):
    """A writable buffer the kernel fills (a memoryview, a numpy array: any contiguous
    buffer): destination shard ``shard`` (an index into the destination's shards), C order,
    in the shard's dtype; ``elements``, when set, says the buffer holds only the elements
    [start, stop) of the shard, counted in C order."""

    shard: int
    buffer: object
    elements: tuple[int, int] | None = None


#: Fills the pieces it is given (one kernel call); raising leaves nothing of the write.
Fill = Callable[[Sequence[Piece]], None]
#: told the destination shards (indices, an int64 array) the next fills fill, in that order
Expect = Callable[["np.ndarray"], None]


class ShardSpan(NamedTuple):
    """Where destination shard ``shard`` (an index into the destination's shards) lies in a
    file: ``nbytes`` at byte ``offset``, C order, items of ``itemsize`` bytes."""

    shard: int
    offset: int
    nbytes: int
    itemsize: int


class ShardSpans(Sequence[ShardSpan]):
    """Many `ShardSpan` held as four columns of equal length (shard indices, offsets, bytes,
    item sizes; lists, or int64 arrays): a format lays out a file of 100k shards without an
    object per shard, and the writer takes the columns as they are. Read as a sequence, it
    makes each span."""

    __slots__ = ("columns",)

    def __init__(self, shards: Sequence[int] | np.ndarray, offsets: Sequence[int] | np.ndarray,
                 nbytes: Sequence[int] | np.ndarray,
                 itemsizes: Sequence[int] | np.ndarray) -> None:
        self.columns = (shards, offsets, nbytes, itemsizes)

    def __len__(self) -> int:
        return len(self.columns[0])

    @overload
    def __getitem__(self, index: int) -> ShardSpan: ...
    @overload
    def __getitem__(self, index: slice) -> list[ShardSpan]: ...
    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return ShardSpan(*(int(column[index]) for column in self.columns))


@dataclass(frozen=True)
class FileLayout:
    """A file as its format lays it out: ``size`` bytes; ``fixed``, (offset, bytes) the
    format writes itself; ``shards``, where each destination shard's bytes go. Bytes neither
    covers are zeros."""

    size: int
    fixed: Sequence[tuple[int, bytes]]
    shards: Sequence[ShardSpan]


@dataclass(frozen=True)
class OutputFile:
    """A destination file: its name, the destination shards it holds (indices, in file
    order) and their bytes."""

    filename: str
    shards: tuple[int, ...]
    nbytes: int


class Destination(ABC):
    """An output checkpoint of one format in ``folder``: ``shards`` (each with a dtype) in
    ``files``, as `plan_files` named them. See the module docstring for the protocol."""

    format: ClassVar[str]
    #: whether the format stores shards of tensors (one file per rank) or whole tensors only
    sharded: ClassVar[bool]
    #: what the format's own files are called, as glob patterns: a folder holding such
    #: files (other than this checkpoint's own) already holds a checkpoint
    patterns: ClassVar[tuple[str, ...]]
    #: the formats whose objects (`Source.objects`) this one writes back (none: it holds
    #: tensors only)
    objects_family: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, folder: str | os.PathLike[str], shards: Sequence[ShardDesc],
                 files: Sequence[OutputFile], extras: Mapping[str, Path] | None = None,
                 objects: Mapping[str, bytes] | None = None, *, direct: bool = True) -> None:
        self.folder = Path(folder)
        #: dtype None reads as float32, as in Paddle
        self.shards = (list(shards) if all(set(map(_DTYPE, shards))) else
                       [shard if shard.dtype else dataclasses.replace(shard, dtype="float32")
                        for shard in shards])
        self.files = list(files)
        self.extras = dict(extras or {})
        #: items that are not tensors, written as these bytes where the format holds such
        #: items (`objects_family`), left out elsewhere
        self.objects = dict(objects or {})
        #: whether to write around the page cache (O_DIRECT) where the file system allows
        self.direct = direct
        #: what a person should know about the write (said once): a refused O_DIRECT
        self.notes: list[str] = []
        self.output = OutputFolder(self.folder, checkpoint_patterns)

    # -- what a format says ----------------------------------------------------------------

    @classmethod
    @abstractmethod
    def plan_files(cls, shards: Sequence[ShardDesc], ranks: Sequence[Sequence[int]] | None,
                   *, max_file_bytes: int | None = None) -> list[OutputFile]:
        """Name the files of ``shards``: one per rank when ``ranks`` (each rank's shard
        indices) is given; else the format groups them (``max_file_bytes``: its limit per
        file, None: its default)."""

    @abstractmethod
    def layout(self, file: OutputFile) -> FileLayout:
        """What ``file`` holds, byte by byte: its headers and where its shards go."""

    def index(self) -> dict[str, bytes]:
        """The small files that make the checkpoint whole once every file is written (an
        index, metadata, files carried over), by name: published last. None by default."""
        return {}

    # -- the protocol, the same for every format -------------------------------------------

    def check(self, sharing: Sharing | None = None) -> None:
        """Lock the output folder (made if missing) for this process alone, or for the
        ranks of ``sharing``; refuse a folder that holds a checkpoint, or that another
        conversion is writing into."""
        self.output.open(sharing)

    def write(self, fill: Fill, files: Sequence[OutputFile] | None = None, *,
              expect: Expect | None = None) -> list[Path]:
        """Fill and finish ``files`` (default: all; or one rank's share) in the staging
        folder; the paths they will have once published. A failure leaves none of them
        (and, for a process writing alone, nothing at all). ``expect``, if given, is told
        before each file's fills which destination shards they will fill, in order."""
        from aoa.storage.writer import StagingBuffers

        self.output.open(self.output.sharing)
        chosen = self.files if files is None else list(files)
        try:
            with StagingBuffers() as buffers:
                for file in chosen:
                    self.write_file(self.output.stage(file.filename), file, fill, buffers,
                                    expect)
                if not all(buffers.finish()):
                    self._refused()
        except BaseException:
            self.output.abort()
            raise
        return [self.folder / file.filename for file in chosen]

    def write_file(self, path: Path, file: OutputFile, fill: Fill, buffers: object,
                   expect: Expect | None = None) -> None:
        """Write ``file`` at ``path`` (in the staging folder) as `layout` says: every byte
        handed to the writers when this returns, the file finishing (fsync) while the next
        one is filled; ``write`` waits for them all."""
        from aoa.storage.writer import StagingBuffers, start_file

        assert isinstance(buffers, StagingBuffers)
        started = start_file(path, self.layout(file), fill, buffers, direct=self.direct,
                             expect=expect)
        if not started.direct:
            self._refused()

    def _refused(self) -> None:
        """The file system refused direct I/O: no use asking again; said once."""
        if self.direct:
            self.direct = False
            self.notes.append(f"{self.folder}: the file system refuses direct I/O (O_DIRECT); "
                              "wrote through the page cache")

    def commit(self) -> list[Path]:
        """Write `index` and publish every file, the index last, then let go of the folder;
        once, by one process. The index's paths."""
        self.output.open(self.output.sharing)
        try:
            index = self.index()
            for name, data in index.items():
                write_file(self.output.stage(name), data)
            self.output.publish([file.filename for file in self.files], list(index))
        except BaseException:
            self.output.abort()
            raise
        self.output.release()  # the checkpoint is whole: the folder is free again
        return [self.folder / name for name in index]

    def close(self) -> None:
        """Let go of the folder: a process writing alone that did not commit removes what
        it wrote; a rank leaves its files for rank 0 to publish."""
        self.output.release()

    def __enter__(self) -> Destination:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:
            self.output.abort()  # a rank too removes its files: the conversion failed
        else:
            self.close()


@dataclass(frozen=True)
class Format:
    """One checkpoint format: its name, how to recognize it, how to read and write it."""

    name: str
    description: str
    #: whether ``path`` (a file or folder) holds this format: a cheap look at names and headers
    claims: Callable[[Path], bool]
    #: opens a checkpoint of this format (None: cannot be read)
    open_source: Callable[[Path], Source] | None
    #: writes one (None: cannot be written)
    destination: type[Destination] | None


def format_named(name: str, role: str = "source") -> Format:
    """The format called ``name``; a UsageError for a name aoa does not know or cannot
    read or write yet (``role``: source or output)."""
    module_name = FORMAT_MODULES.get(name)
    if module_name is None:
        raise UsageError(f"unknown {role} format '{name}'",
                         hint=f"Choose one of: {', '.join(FORMAT_NAMES)}.")
    found = _load(module_name)
    able = found is not None and (found.open_source if role == "source" else found.destination)
    if not able:
        usable = [n for n in FORMAT_NAMES if _can(n, role)]
        what = "read" if role == "source" else "written"
        raise UsageError(f"{role} format '{name}' cannot be {what} by this version of aoa",
                         hint=f"Formats it can: {', '.join(usable)}.")
    assert found is not None
    return found


def detect(path: Path) -> Format:
    """The format of the checkpoint at ``path``: the first that claims it. Where none does,
    safetensors, whose reader then says what the folder lacks; a file none claims is read
    as safetensors only if it starts like one (whatever its name), else refused with what
    aoa reads instead of a reader's guess at its bytes."""
    for module_name in FORMAT_MODULES.values():
        found = _load(module_name)
        if found is not None and found.open_source is not None and found.claims(path):
            return found
    if path.is_file() and not _looks_like_safetensors(path):
        why = ("it is neither a zip archive, as torch.save has written since torch 1.6, nor "
               "in torch.save's legacy format (not written by torch.save)"
               if path.suffix in (".bin", ".pt", ".pth") else
               "by its name and first bytes it is no safetensors file, torch.save archive or "
               "checkpoint metadata")
        raise StorageError(f"{path}: not a checkpoint aoa reads: {why}", hint=_READABLE)
    return format_named("safetensors")


_READABLE = ("Give a safetensors file or folder, a pytorch_model.bin or its index, a Paddle "
             "{n}.metadata, a PyTorch DCP or Megatron torch_dist folder, or shard-info JSON; "
             "--source-format names the format.")


def _looks_like_safetensors(path: Path) -> bool:
    """An 8-byte little-endian header length that fits the file, then a JSON object."""
    with open(path, "rb") as file:
        start = file.read(9)
    if len(start) < 9:
        return False
    length = int.from_bytes(start[:8], "little")
    return start[8:9] == b"{" and 2 <= length <= path.stat().st_size - 8


def open_source(path: str | os.PathLike[str], format: str | None = None) -> Source:
    """Open the checkpoint at ``path`` (a file or folder) as ``format`` (default: detected)."""
    path = Path(path)
    found = format_named(format) if format is not None else detect(path)
    assert found.open_source is not None
    with collector_paused():  # a record or a few per stored chunk, and no cycles
        return found.open_source(path)


def checkpoint_patterns() -> tuple[str, ...]:
    """The names of every writable format's files, as glob patterns: an output folder
    holding such files already holds a checkpoint."""
    return tuple(sorted({pattern for name in FORMAT_NAMES for pattern in _patterns(name)}))


def _patterns(name: str) -> tuple[str, ...]:
    found = _load(FORMAT_MODULES[name])
    return found.destination.patterns if found is not None and found.destination else ()


def _can(name: str, role: str) -> bool:
    found = _load(FORMAT_MODULES[name])
    return found is not None and bool(found.open_source if role == "source"
                                      else found.destination)


def _load(module_name: str) -> Format | None:
    """The FORMAT of a format's module, or None while the module does not exist."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        return None
    return module.FORMAT


@contextlib.contextmanager
def opened(source: str | os.PathLike[str] | Source, format: str | None = None):
    """A source given as a path (opened here, closed after) or already open (left open)."""
    if isinstance(source, Source):
        yield source
        return
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(f"source must be a checkpoint folder or file, not "
                         f"{type(source).__name__}")
    with open_source(source, format) as checkpoint:
        yield checkpoint
