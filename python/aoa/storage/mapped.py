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
from aoa.storage.formats import Source
from aoa.storage.pages import PageRelease

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
