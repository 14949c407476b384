"""Files read through a read-only memory mapping, and where a stored shard's bytes lie in one.

The formats whose tensors sit at byte offsets of a larger file (Paddle's ``.distcp`` pickles,
PyTorch DCP's archives, ``pytorch_model.bin``) share this: a shard is a byte range of a
mapped file (no copy), or, for a tensor stored strided (a transposed view torch saved as
is), a range it is gathered from into C order.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aoa.errors import StorageError
from aoa.layout import ShardDesc
from aoa.storage.folder import sync_folder
from aoa.storage.formats import Source
from aoa.storage.pages import PageRelease
from aoa.storage.safetensors import _prefault as prefault
from aoa.storage.safetensors import _reserve as reserve
from aoa.storage.safetensors import partial_path

if TYPE_CHECKING:
    import numpy as np


class MappedFile:
    """A whole file mapped read-only; views are slices of the mapping."""

    def __init__(self, path: Path, mapping: mmap.mmap | None, size: int) -> None:
        self.path = path
        self.size = size
        self._mapping = mapping
        self._pages = PageRelease(mapping)
        self.data = memoryview(mapping) if mapping is not None else memoryview(b"")

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> MappedFile:
        path = Path(path)
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except FileNotFoundError:
            raise StorageError(f"{path}: no such file") from None
        except OSError as error:
            raise StorageError(f"{path}: cannot open: {error.strerror}") from error
        return cls(path, mapping, size)

    def view(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or offset + nbytes > self.size:
            raise StorageError(f"{self.path}: bytes [{offset}, {offset + nbytes}) lie past the "
                               f"end of the file ({self.size} bytes)")
        return self.data[offset:offset + nbytes]

    def release(self, offset: int, nbytes: int) -> None:
        """Drop these bytes' pages from this process's memory (they stay in the page cache),
        in batches (`PageRelease`)."""
        self._pages.release(offset, nbytes)

    def close(self) -> None:
        """Unmap; views still held elsewhere keep the mapping alive until they go."""
        self._pages.close()
        with contextlib.suppress(BufferError):
            self.data.release()
        if self._mapping is not None:
            with contextlib.suppress(BufferError):
                self._mapping.close()
            self._mapping = None


@dataclass(frozen=True)
class Stored:
    """Where a shard's bytes lie: ``nbytes`` at ``offset`` of ``file``, in C order; or, with
    ``gather``, a range of it that ``gather`` turns into the shard's C-order bytes."""

    file: MappedFile
    offset: int
    nbytes: int
    gather: Callable[[memoryview], np.ndarray] | None = None

    def buffer(self) -> memoryview:
        view = self.file.view(self.offset, self.nbytes)
        if self.gather is None:
            return view
        gathered: Any = self.gather(view)
        return memoryview(gathered).cast("B")

    def release(self) -> None:
        self.file.release(self.offset, self.nbytes)


class MappedFiles:
    """The files a source has open, each mapped once, closed together."""

    def __init__(self) -> None:
        self.files: dict[Path, MappedFile] = {}

    def open(self, path: Path) -> MappedFile:
        found = self.files.get(path)
        if found is None:
            found = self.files[path] = MappedFile.open(path)
        return found

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.files.clear()


class MappedSource(Source[Stored]):
    """A source whose shards are byte ranges of files it has mapped (`Stored`): Paddle's
    ``.distcp``, PyTorch DCP and ``torch.save`` files. A subclass sets ``_files``."""

    _files: MappedFiles

    def buffer(self, shard: ShardDesc) -> memoryview:
        return self.location(shard).buffer()

    def release(self, shard: ShardDesc) -> None:
        self.location(shard).release()

    def file_of(self, shard: ShardDesc) -> Path:
        return self.location(shard).file.path

    def plan_extents(self, shards: Sequence[ShardDesc]
                     ) -> tuple[list[Path], Callable[[np.ndarray], np.ndarray]]:
        """The mapped files, and each asked shard's range in its file (looked up when asked:
        only a source not in memory is asked, once per shard)."""
        import numpy as np

        paths = list(self._files.files)
        numbers = {path: number for number, path in enumerate(paths)}

        def extents(indices: np.ndarray) -> np.ndarray:
            found = self.locations([shards[index] for index in indices.tolist()])
            return np.array([(numbers[stored.file.path], stored.offset, stored.nbytes)
                             for stored in found], np.int64).reshape(-1, 3)

        return paths, extents

    def close(self) -> None:
        self._files.close()


class MappedWriter:
    """A file of ``nbytes`` written in place: ``.<name>.aoa-partial`` sized (blocks
    allocated) and mapped up front, filled through `view`, fsynced by `finish`, renamed into
    place by `commit`; `discard` removes what it left. As `SafetensorsWriter`, for files
    whose layout is known before their bytes."""

    def __init__(self, path: str | os.PathLike[str], nbytes: int) -> None:
        self.path = Path(path)
        self.partial = partial_path(self.path)
        self.nbytes = nbytes
        self._committed = False
        self._views: list[memoryview] = []
        self._mapping: mmap.mmap | None = None
        self._fd: int | None = None
        try:
            self._fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
        except OSError as error:
            raise StorageError(f"{self.path}: cannot write: {error.strerror}") from error
        try:
            reserve(self._fd, nbytes)
            if nbytes:
                self._mapping = mmap.mmap(self._fd, nbytes, access=mmap.ACCESS_WRITE)
                prefault(self._mapping)
        except OSError as error:
            self.discard()
            raise StorageError(f"{self.path}: cannot reserve {nbytes} bytes: "
                               f"{error.strerror}") from error

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """A writable view of bytes [offset, offset + nbytes) of the file."""
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or offset + nbytes > self.nbytes:
            raise StorageError(f"{self.path}: bytes [{offset}, {offset + nbytes}) lie outside "
                               f"the file's {self.nbytes}")
        if not nbytes:
            return memoryview(bytearray())
        if self._mapping is None:
            raise StorageError(f"{self.path}: already finished")
        view = memoryview(self._mapping)[offset:offset + nbytes]
        self._views.append(view)
        return view

    def finish(self) -> None:
        """Flush and fsync, then unmap: complete, but not under its name yet."""
        if self._fd is None:
            return
        try:
            if self._mapping is not None:
                self._mapping.flush()
            os.fsync(self._fd)
        except OSError as error:
            raise StorageError(f"{self.path}: cannot write: {error.strerror}") from error
        finally:
            self._close()

    def commit(self) -> Path:
        """Finish, then rename into place (atomically, over any older file)."""
        self.finish()
        if not self._committed:
            try:
                os.replace(self.partial, self.path)
                sync_folder(self.path.parent)
            except OSError as error:
                raise StorageError(f"{self.path}: cannot write: {error.strerror}") from error
            self._committed = True
        return self.path

    def discard(self) -> None:
        """Remove what this writer left: the partial file, or the final file once committed."""
        self._close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path if self._committed else self.partial)

    def _close(self) -> None:
        for view in self._views:
            with contextlib.suppress(BufferError):
                view.release()
        self._views.clear()
        if self._mapping is not None:
            with contextlib.suppress(BufferError):
                self._mapping.close()
            self._mapping = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
