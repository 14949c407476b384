"""A file written in place through a writable mapping, and put under its name only whole.

It is made as a dot-file beside its name (`partial_path`: no reader picks it up), its
blocks reserved and its pages faulted in up front, filled through views of the mapping,
fsynced, then renamed into place atomically. For files whose layout is known before their
bytes and whose format writes into them after the fill (a safetensors file written by the
library, a DCP archive's CRC-32s); a conversion's large files go through the staging writer
(`aoa.storage.writer`), around the page cache.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import sys
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from aoa.errors import StorageError
from aoa.storage.folder import sync_folder

#: The suffix of a file being written (after a dot and its final name).
PARTIAL_SUFFIX = ".aoa-partial"
#: Linux's MADV_POPULATE_WRITE (5.14+; Python 3.11's mmap module lacks the name).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_Writer = TypeVar("_Writer", bound="InPlaceWriter")


def partial_path(path: Path) -> Path:
    """Where ``path`` is written before it is complete: a dot-file no reader picks up."""
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


class InPlaceWriter:
    """A file of ``nbytes`` written in place: `partial_path` sized (blocks allocated) and
    mapped up front, filled through `view`, fsynced by `finish`, renamed into place by
    `commit`; `discard` removes what it left.

    A ``with`` block is the unit of atomicity: if it raises, whatever the writer left (the
    partial file, or the final file if it was already committed) is removed; leaving it
    without committing removes the partial file. A killed process leaves only the dot-file.
    """

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
            _reserve(self._fd, nbytes)
            if nbytes:
                self._mapping = mmap.mmap(self._fd, nbytes, access=mmap.ACCESS_WRITE)
                _prefault(self._mapping)
        except OSError as error:
            self.discard()
            raise StorageError(f"{self.path}: cannot reserve {nbytes} bytes: "
                               f"{error.strerror}") from error

    def view(self, offset: int = 0, nbytes: int | None = None) -> memoryview:
        """A writable view of bytes [offset, offset + nbytes) of the file."""
        nbytes = self.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
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

    def __enter__(self: _Writer) -> _Writer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is not None or not self._committed:
            self.discard()

    def _close(self) -> None:
        """Release our views (a stale one then fails instead of writing into a finished file)
        and unmap; a view held elsewhere keeps the mapping alive until it goes."""
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


def _reserve(fd: int, size: int) -> None:
    """Give the file its final size with the blocks allocated, so a full disk is an error
    here rather than a SIGBUS in the middle of a copy into the mapping."""
    os.ftruncate(fd, size)
    allocate(fd, size)


def allocate(fd: int, size: int) -> None:
    """Allocate the blocks of the file's first ``size`` bytes up front: a full disk is an
    OSError here, not in the middle of a write. A file system that cannot reserve blocks
    (or a size of 0) passes: its writes then say when the disk is full."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def _prefault(mapping: mmap.mmap) -> None:
    """Fault the whole file's pages in at once: the kernel then writes into them three
    times faster than when each first touch of a page traps. Older kernels say EINVAL
    (harmless: the pages then fault one by one, as before)."""
    if sys.platform.startswith("linux") and len(mapping):
        with contextlib.suppress(OSError):
            mapping.madvise(_MADV_POPULATE_WRITE)
