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
        destination.check()             refuse a folder holding another checkpoint
        destination.write(fill, files)  fill and finish these files (all, or a rank's share)
        destination.commit()            once, after every file is written: makes it whole

``write`` hands ``fill`` the writable buffers of each file's shards as `Piece` records
(shard index, buffer, rows) and lets the kernel fill them in place. The destination, not its
caller, decides how many pieces go in one call and what memory backs them, which is what
leaves room for the two changes planned there, with no change to any caller:

* Issue 13, goal 3 (write at disk speed, bounded memory): instead of mapping a whole file,
  ``write`` can hand out aligned staging buffers of a fixed size, each one a row range of a
  shard (``Piece.rows``), and write each filled one with ``O_DIRECT`` while ``fill`` fills the
  next. The executor already fills row ranges (`aoa.runtime.executor.PlanExecutor.fill`).
* Issue 12, items 2-4 (one atomic commit for many files, a locked output folder): ``check``
  can take the folder's lock (released by ``close``, at the end of the ``with`` block),
  ``write`` can leave its files staged under hidden names, and ``commit`` can publish all of
  them and the index in one step (a staging folder renamed, or a marker written last).

Today's semantics: ``write`` fills each file through a memory mapping of the final size,
fsyncs it, and renames all files of the call into place together; a failure (a fill, a
rename) removes every file of the call, so the folder holds nothing of it. ``commit`` writes
the index, where the format has one.

**A new format** is a module named in `FORMAT_MODULES` whose ``FORMAT`` is a `Format`: a
`Source` subclass (a sharded format builds each key's shards with
`aoa.storage.chunks.key_shards`, which checks replicas and tiling), a `Destination`
subclass (or None for a read-only format) that keeps today's all-or-nothing rule, and a
cheap ``claims``. Nothing outside the module changes.

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
import importlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Generic, NamedTuple, TypeVar

from aoa.errors import StorageError, UsageError
from aoa.layout import ShardDesc

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


class Source(ABC, Generic[Location]):
    """An open source checkpoint: its shards by key, and read-only buffers over their bytes.

    A format subclasses it with its own ``Location`` (where a shard's bytes are) and passes
    every shard with its location to ``__init__``."""

    def __init__(self, path: Path, format: str,
                 stored: Mapping[str, Sequence[tuple[ShardDesc, Location]]]) -> None:
        self.path = path
        self.format = format
        #: each key's distinct shards, sorted by global offset
        self.shards: dict[str, list[ShardDesc]] = {
            key: [shard for shard, _ in found] for key, found in stored.items()}
        self._locations: dict[tuple[str, tuple[int, ...]], Location] = {
            (shard.key, shard.global_offset): location
            for found in stored.values() for shard, location in found}

    def location(self, shard: ShardDesc) -> Location:
        """Where the stored shard of ``shard``'s key at its global offset is."""
        try:
            return self._locations[(shard.key, shard.global_offset)]
        except KeyError:
            raise StorageError(f"{self.path}: holds no shard of '{shard.key}' at global offset "
                               f"{list(shard.global_offset)}") from None

    @abstractmethod
    def buffer(self, shard: ShardDesc) -> memoryview:
        """The shard's bytes, C order, read-only (a view of the file's mapping where it can)."""

    def release(self, shard: ShardDesc) -> None:
        """Drop the pages of a shard read once from this process's memory (they stay in the
        page cache): keeps a long job's resident size near what it writes."""

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


class Piece(NamedTuple):
    """A writable buffer the kernel fills (a memoryview, a numpy array: any contiguous
    buffer): destination shard ``shard`` (an index into the destination's shards), C order,
    in the shard's dtype; ``rows``, when set, says the buffer holds only rows [start, stop)
    of the shard's first axis."""

    shard: int
    buffer: object
    rows: tuple[int, int] | None = None


#: Fills the pieces it is given (one kernel call); raising leaves nothing of the write.
Fill = Callable[[Sequence[Piece]], None]


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
                 objects: Mapping[str, bytes] | None = None) -> None:
        self.folder = Path(folder)
        #: dtype None reads as float32, as in Paddle
        self.shards = [shard if shard.dtype else dataclasses.replace(shard, dtype="float32")
                       for shard in shards]
        self.files = list(files)
        self.extras = dict(extras or {})
        #: items that are not tensors, written as these bytes where the format holds such
        #: items (`objects_family`), left out elsewhere
        self.objects = dict(objects or {})

    @classmethod
    @abstractmethod
    def plan_files(cls, shards: Sequence[ShardDesc], ranks: Sequence[Sequence[int]] | None,
                   *, max_file_bytes: int | None = None) -> list[OutputFile]:
        """Name the files of ``shards``: one per rank when ``ranks`` (each rank's shard
        indices) is given; else the format groups them (``max_file_bytes``: its limit per
        file, None: its default)."""

    def check(self, others_may_have_written: bool = False) -> None:
        """Refuse an output that is a file, or a folder already holding a checkpoint of any
        format; with ``others_may_have_written`` (ranks that do not wait for each other),
        files of this very checkpoint are allowed."""
        ours = {file.filename for file in self.files} if others_may_have_written else set()
        check_output_folder(self.folder, ours)

    @abstractmethod
    def write(self, fill: Fill, files: Sequence[OutputFile] | None = None) -> list[Path]:
        """Fill and finish ``files`` (default: all; or one rank's share). A failure leaves
        none of them."""

    @abstractmethod
    def commit(self) -> list[Path]:
        """What makes the checkpoint whole once every file is written (the index, files
        carried over); run once, by one process."""

    def close(self) -> None:  # noqa: B027 - nothing is held today
        """Release what ``check`` took (the folder's lock, once there is one); jobs use a
        destination in a ``with`` block."""

    def __enter__(self) -> Destination:
        return self

    def __exit__(self, *exc: object) -> None:
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
    safetensors, whose reader then says what the folder lacks."""
    for module_name in FORMAT_MODULES.values():
        found = _load(module_name)
        if found is not None and found.open_source is not None and found.claims(path):
            return found
    return format_named("safetensors")


def open_source(path: str | os.PathLike[str], format: str | None = None) -> Source:
    """Open the checkpoint at ``path`` (a file or folder) as ``format`` (default: detected)."""
    path = Path(path)
    found = format_named(format) if format is not None else detect(path)
    assert found.open_source is not None
    return found.open_source(path)


def check_output_folder(folder: Path, ours: set[str] | frozenset[str] = frozenset()) -> None:
    """Refuse an output that is a file, or a folder holding checkpoint files of any format
    other than ``ours`` (files of two runs would mix)."""
    if folder.exists() and not folder.is_dir():
        raise StorageError(f"{folder}: the output is a file, not a folder")
    if not folder.is_dir():
        return
    patterns = {pattern for name in FORMAT_NAMES for pattern in _patterns(name)}
    foreign = sorted({path.name for pattern in patterns for path in folder.glob(pattern)
                      if path.name not in ours and not path.name.startswith(".")})
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more"
                                          if len(foreign) > 3 else "")
        raise StorageError(f"{folder}: the output folder already holds a checkpoint ({shown})",
                           hint="Convert into an empty or new folder.")


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
