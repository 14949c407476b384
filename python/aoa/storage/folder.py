"""The output folder as every destination format writes it: made on demand, the files of one
write staged and renamed into place together, small files (an index) written atomically."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from aoa.errors import StorageError
from aoa.layout import ShardDesc
from aoa.storage.mapped import MappedWriter
from aoa.storage.safetensors import SafetensorsWriter, partial_path


def output_folder(folder: str | os.PathLike[str]) -> Path:
    """``folder``, made (with its parents) if it is not there."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise StorageError(
            f"{folder}: cannot create the output folder: {error.strerror}"
        ) from error
    if not folder.is_dir():
        raise StorageError(f"{folder}: cannot create the output folder: not a folder")
    return folder


class Staging:
    """The files of one write call: each filled and finished in turn, then all renamed into
    place together. If anything fails (a fill, a rename), every file of the call is removed,
    partial or already renamed, so the folder holds nothing of the failed call; a file of the
    same name from an earlier run survives a failure before the renames, not one during."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.writers: list[SafetensorsWriter | MappedWriter] = []

    @contextlib.contextmanager
    def safetensors(
        self, name: str, tensors: Sequence[ShardDesc], metadata: dict[str, str] | None
    ) -> Iterator[SafetensorsWriter]:
        """A safetensors file of the call, finished (fsynced, unmapped) when the block ends."""
        writer = SafetensorsWriter(self.folder / name, tensors, metadata)
        self.writers.append(writer)
        yield writer
        writer.finish()

    @contextlib.contextmanager
    def mapped(self, name: str, nbytes: int) -> Iterator[MappedWriter]:
        """A file of ``nbytes`` laid out by its format, finished when the block ends."""
        writer = MappedWriter(self.folder / name, nbytes)
        self.writers.append(writer)
        yield writer
        writer.finish()

    def commit(self) -> list[Path]:
        return [writer.commit() for writer in self.writers]

    def __enter__(self) -> Staging:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:
            for writer in self.writers:
                writer.discard()


def write_text(path: Path, text: str) -> None:
    """Write a small file atomically: a partial dot-file, fsync, rename."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: Path, data: bytes) -> None:
    """Write a small file atomically: a partial dot-file, fsync, rename."""
    partial = partial_path(path)
    try:
        with open(partial, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except OSError as error:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        raise StorageError(f"{path}: cannot write: {error.strerror}") from error


def remove(paths: Sequence[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
