"""Checkpoint folders: the source shards a plan reads and the destination files it writes.

Two layouts, both plain safetensors:

* Hugging Face: ``model.safetensors``, or ``model-00001-of-00003.safetensors`` ... with a
  ``model.safetensors.index.json`` whose ``weight_map`` says which file holds each key.
  Every tensor is whole: global offset zeros, global shape its shape.
* Sharded, the way PyTorch DCP's Hugging Face storage writes it: each file's metadata key
  ``DCP_SHARDING_INFO`` holds JSON ``{key: {"saved_offsets": [...]}}``, the global offset
  of that file's chunk of ``key``. Chunks of one key may lie in several files; the global
  shape is where the furthest chunk ends on each axis. aoa writes one file per rank,
  ``rank-00000-of-00004.safetensors`` ...

Writing is planned first (what goes in which file, a pure function), then done per file,
so a dry run can print the plan and several processes can each write their own files.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from aoa.dtypes import itemsize
from aoa.errors import StorageError
from aoa.storage.safetensors import (
    SafetensorsFile,
    SafetensorsWriter,
    TensorSpec,
    partial_path,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARDING_KEY = "DCP_SHARDING_INFO"
OFFSETS_KEY = "saved_offsets"
#: Written beside the sharding info, as DCP's Hugging Face storage writer does.
_DCP_VERSION = {"DCP_VERSION": "1.0"}


# ---------------------------------------------------------------------------- source side


@dataclass(frozen=True)
class SourceShard:
    """One stored chunk of source tensor ``key``: where it sits in the global tensor and in
    which file its bytes are."""

    key: str
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    dtype: str
    file: Path
    nbytes: int


class SourceCheckpoint:
    """The open files of a source checkpoint and its shards by key, each list sorted by
    global offset."""

    def __init__(self, path: Path, files: dict[Path, SafetensorsFile]) -> None:
        self.path = path
        self._files = files
        self.shards = _shards(files)

    def buffer(self, shard: SourceShard) -> memoryview:
        """The shard's bytes, read-only, straight from the file's mapping."""
        return self._files[shard.file].buffer(shard.key)

    def release(self, shard: SourceShard) -> None:
        """Drop the shard's pages from memory once read (see SafetensorsFile.release)."""
        self._files[shard.file].release(shard.key)

    def close(self) -> None:
        for file in self._files.values():
            file.close()

    def __enter__(self) -> SourceCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_source_checkpoint(path: str | os.PathLike[str]) -> SourceCheckpoint:
    """Open a safetensors file, or a folder of them (Hugging Face or DCP-sharded).

    The files of a folder are those its index names, or else every ``*.safetensors`` in it.
    """
    path = Path(path)
    index = path / INDEX_NAME
    if path.is_file() and path.name.endswith(".index.json"):
        index = path  # an index names its folder's files
    weight_map = None
    if path.is_file() and index != path:
        names = [path]
    elif index.is_file():
        weight_map = _read_index(index)
        names = _index_files(index, weight_map)
    elif path.is_dir():
        names = _folder_files(path)
    else:
        raise StorageError(f"{path}: no such checkpoint file or folder")
    files: dict[Path, SafetensorsFile] = {}
    try:
        for name in names:
            files[name] = SafetensorsFile.open(name)
        if weight_map is not None:
            _check_index(index, weight_map, files)
        return SourceCheckpoint(path, files)
    except BaseException:
        for file in files.values():
            file.close()
        raise


def _folder_files(folder: Path) -> list[Path]:
    names = sorted(
        name
        for name in folder.glob("*.safetensors")
        if name.is_file() and not name.name.startswith(".")
    )
    if not names:
        raise StorageError(f"{folder}: no .safetensors files in this folder")
    return names


def _read_index(index: Path) -> dict[str, str]:
    """The weight map of an index file, checked to be an object of key -> file name."""
    try:
        content = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise StorageError(f"{index}: cannot read the index: {error}") from None
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(key, str) and isinstance(name, str) for key, name in weight_map.items()
    ):
        raise StorageError(f"{index}: index has no weight_map object of key -> file name")
    return weight_map


def _index_files(index: Path, weight_map: dict[str, str]) -> list[Path]:
    """The files an index names, each checked to exist beside it."""
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name != name:
            raise StorageError(f"{index}: file name '{name}' is not a name inside the folder")
        if not (index.parent / name).is_file():
            raise StorageError(f"{index}: names shard file '{name}', which does not exist")
    return [index.parent / name for name in names]


def _check_index(
    index: Path, weight_map: dict[str, str], files: dict[Path, SafetensorsFile]
) -> None:
    """Each key the index names is in the file it names, and each key stored is named.

    (DCP maps a key split over several files to one of them; that passes both checks.)
    """
    for key, name in weight_map.items():
        if key not in files[index.parent / name].tensors:
            raise StorageError(
                f"{index}: says tensor '{key}' is in '{name}', which does not hold it"
            )
    for file in files.values():
        for key in file.tensors:
            if key not in weight_map:
                raise StorageError(f"{file.path}: tensor '{key}' is not in the index {index}")


def _shards(files: dict[Path, SafetensorsFile]) -> dict[str, list[SourceShard]]:
    """Every stored chunk, grouped by key, with global shapes and the checks between chunks."""
    chunks: dict[str, list[tuple[SafetensorsFile, tuple[int, ...] | None]]] = {}
    for file in files.values():
        offsets = _sharding_info(file)
        for key in file.tensors:
            chunks.setdefault(key, []).append((file, offsets.get(key)))
    return {key: _key_shards(key, found) for key, found in chunks.items()}


def _sharding_info(file: SafetensorsFile) -> dict[str, tuple[int, ...]]:
    """Global offset of each chunk in ``file``, from its DCP metadata (empty if none)."""
    text = file.metadata.get(SHARDING_KEY)
    if text is None:
        return {}
    where = f"{file.path}: {SHARDING_KEY}"
    try:
        info = json.loads(text)
    except ValueError as error:
        raise StorageError(f"{where} is not JSON: {error}") from None
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
                f"{where}: tensor '{key}' has saved_offsets {saved!r}, not {ndim} "
                f"non-negative integers"
            )
        offsets[key] = tuple(saved)
    return offsets


def _key_shards(
    key: str, found: list[tuple[SafetensorsFile, tuple[int, ...] | None]]
) -> list[SourceShard]:
    """The shards of one key: all of one dtype and rank, tiling the global shape exactly."""
    if len(found) > 1 and any(offset is None for _, offset in found):
        files = ", ".join(str(file.path) for file, _ in found)
        raise StorageError(
            f"tensor '{key}' is stored in several files without {SHARDING_KEY}: {files}"
        )
    first_file = found[0][0]
    first = first_file.tensors[key]
    for file, _ in found:
        info = file.tensors[key]
        if info.dtype != first.dtype or len(info.shape) != len(first.shape):
            raise StorageError(
                f"tensor '{key}' is {info.dtype} {list(info.shape)} in {file.path} but "
                f"{first.dtype} {list(first.shape)} in {first_file.path}"
            )
    chunks = [
        (file.path, file.tensors[key], offset or (0,) * len(first.shape)) for file, offset in found
    ]
    ends = [
        tuple(start + size for start, size in zip(offset, info.shape, strict=True))
        for _, info, offset in chunks
    ]
    global_shape = tuple(map(max, zip(*ends, strict=True)))
    shards = [
        SourceShard(key, info.shape, global_shape, offset, info.dtype, path, info.nbytes)
        for path, info, offset in chunks
    ]
    shards.sort(key=lambda shard: shard.global_offset)
    # Replicas (every rank of a data- or tensor-parallel group saving a replicated tensor)
    # are the same box stored twice: keep the first, check the rest for tiling.
    first_of: dict[tuple, SourceShard] = {}
    for shard in shards:
        first_of.setdefault((shard.global_offset, shard.local_shape), shard)
    distinct = list(first_of.values())
    _check_tiling(key, distinct)
    return distinct


#: Above this many boundary-grid cells (irregular chunks), compare chunks pairwise instead.
_MAX_GRID_CELLS = 1 << 22


def _check_tiling(key: str, shards: list[SourceShard]) -> None:
    """No two chunks share an element, and together they cover the global shape."""
    shape = shards[0].global_shape
    solid = [shard for shard in shards if math.prod(shard.local_shape)]  # others hold nothing
    boxes = (len(solid), len(shape))
    starts = np.array([shard.global_offset for shard in solid], np.int64).reshape(boxes)
    ends = starts + np.array([shard.local_shape for shard in solid], np.int64).reshape(boxes)
    pair = _overlapping_pair(starts, ends)
    if pair is not None:
        first, second = (solid[n] for n in pair)
        raise StorageError(
            f"tensor '{key}': chunk at {list(first.global_offset)} in {first.file} "
            f"overlaps chunk at {list(second.global_offset)} in {second.file}"
        )
    covered = sum(math.prod(shard.local_shape) for shard in solid)
    if covered != math.prod(shape):
        raise StorageError(
            f"tensor '{key}': its chunks cover {covered} of the {math.prod(shape)} elements of "
            f"its global shape {list(shape)}; files: "
            + ", ".join(sorted({str(shard.file) for shard in shards}))
        )


def _overlapping_pair(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    """Two boxes [start, end) that share an element, if any.

    Counted on the grid of all box boundaries: a cell between consecutive boundaries is
    wholly inside a box or wholly outside, so a cell inside two boxes is an overlap. The
    counts come from a difference array (+1/-1 at each box's corners, then a cumulative sum
    per axis), in time linear in boxes and cells; irregular boxes fall back to pairs.
    """
    count, ndim = starts.shape
    if count < 2:
        return None
    if ndim == 0:
        return (0, 1)
    bounds = [np.unique(np.concatenate([starts[:, a], ends[:, a]])) for a in range(ndim)]
    if math.prod(len(b) - 1 for b in bounds) > _MAX_GRID_CELLS:
        return _overlapping_pair_pairwise(starts, ends)
    low = [np.searchsorted(bounds[a], starts[:, a]) for a in range(ndim)]
    high = [np.searchsorted(bounds[a], ends[:, a]) for a in range(ndim)]
    cells = np.zeros([len(b) for b in bounds], np.int32)
    for corner in itertools.product((False, True), repeat=ndim):
        index = tuple(high[a] if up else low[a] for a, up in enumerate(corner))
        np.add.at(cells, index, -1 if sum(corner) % 2 else 1)
    for axis in range(ndim):
        cells = np.cumsum(cells, axis=axis)
    crowded = np.argwhere(cells > 1)
    if not len(crowded):
        return None
    point = np.array([bounds[a][crowded[0][a]] for a in range(ndim)])
    inside = np.flatnonzero(((starts <= point) & (point < ends)).all(axis=1))
    return int(inside[0]), int(inside[1])


def _overlapping_pair_pairwise(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    """The same answer by comparing each box with every later one, a block at a time."""
    for first in range(0, len(starts), 256):
        block = slice(first, first + 256)
        inner = np.minimum(ends[block, None], ends[None]) > np.maximum(
            starts[block, None], starts[None]
        )
        shared = inner.all(axis=2) & (
            np.arange(len(starts))[None] > np.arange(first, first + len(inner))[:, None]
        )
        if shared.any():
            i, j = np.argwhere(shared)[0]
            return first + int(i), int(j)
    return None


# ----------------------------------------------------------------------- destination side


class HfFile(NamedTuple):
    """One file of a Hugging Face destination and the whole tensors it holds, in order."""

    filename: str
    tensors: Sequence[TensorSpec]


@dataclass(frozen=True)
class ShardSpec:
    """One destination shard: its key, dtype, local shape and global offset."""

    key: str
    dtype: str
    local_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.local_shape) * itemsize(self.dtype)


class RankFile(NamedTuple):
    """The one file a rank of a sharded destination writes, and the shards in it, in order."""

    filename: str
    tensors: Sequence[ShardSpec]


def plan_hf_files(tensors: Sequence[TensorSpec], max_file_bytes: int = 5 * 10**9) -> list[HfFile]:
    """Split ``tensors``, in order, into files of at most ``max_file_bytes`` of tensor data
    (headers not counted, as in Hugging Face's own sharding); a tensor larger than that gets
    a file of its own. One file is ``model.safetensors``; several are numbered."""
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    names: set[str] = set()
    for spec in tensors:
        if spec.name in names:
            raise StorageError(f"tensor '{spec.name}' appears twice among the destination tensors")
        names.add(spec.name)
        if groups[-1] and size + spec.nbytes > max_file_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    if len(groups) == 1:
        return [HfFile(SINGLE_NAME, groups[0])]
    count = len(groups)
    return [
        HfFile(f"model-{number:05d}-of-{count:05d}.safetensors", group)
        for number, group in enumerate(groups, start=1)
    ]


def plan_rank_files(ranks: Sequence[Sequence[ShardSpec]]) -> list[RankFile]:
    """Name one file per rank, ``rank-00000-of-00004.safetensors`` (ranks counted from 0)."""
    count = len(ranks)
    return [
        RankFile(f"rank-{rank:05d}-of-{count:05d}.safetensors", shards)
        for rank, shards in enumerate(ranks)
    ]


def write_hf_files(
    folder: str | os.PathLike[str],
    files: Sequence[HfFile],
    fill_tensor: Callable[[str, memoryview], None],
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write these files of a plan (all of them, or the share of one process); ``metadata``
    goes into each file's header. A failure leaves none of them (see :class:`_Staging`)."""
    folder = _output_folder(folder)
    with _Staging(folder) as staging:
        for name, tensors in files:
            with staging.file(name, tensors, metadata) as writer:
                for spec in tensors:
                    fill_tensor(spec.name, writer.buffer(spec.name))
        return staging.commit()


def write_hf_index(folder: str | os.PathLike[str], plan: Sequence[HfFile]) -> Path | None:
    """Write ``model.safetensors.index.json`` for the whole plan, atomically; call it once
    every file is written. A plan of one ``model.safetensors`` needs no index (None), and an
    older index there is removed: readers would follow it to files of another checkpoint."""
    folder = _output_folder(folder)
    if len(plan) == 1 and plan[0].filename == SINGLE_NAME:
        _remove([folder / INDEX_NAME])
        return None
    index = {
        "metadata": {"total_size": sum(spec.nbytes for file in plan for spec in file.tensors)},
        "weight_map": {spec.name: file.filename for file in plan for spec in file.tensors},
    }
    path = folder / INDEX_NAME
    _write_text(path, json.dumps(index, indent=2) + "\n")
    return path


def write_hf_checkpoint(
    folder: str | os.PathLike[str],
    tensors: Sequence[TensorSpec],
    fill_tensor: Callable[[str, memoryview], None],
    max_file_bytes: int = 5 * 10**9,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Plan, write every file, then the index. If anything fails, none of it remains."""
    plan = plan_hf_files(tensors, max_file_bytes)
    paths = write_hf_files(folder, plan, fill_tensor, metadata)
    try:
        index = write_hf_index(folder, plan)
    except BaseException:
        _remove(paths)
        raise
    return [*paths, index] if index else paths


def write_sharded_checkpoint(
    folder: str | os.PathLike[str],
    ranks: Sequence[RankFile],
    fill_shard: Callable[[str, ShardSpec, memoryview], None],
) -> list[Path]:
    """Write these rank files (all of them, or a process's own), each shard under its key
    with its global offset in ``DCP_SHARDING_INFO``; ``fill_shard(filename, shard, view)``
    writes its bytes. No index: a reader takes every ``*.safetensors`` of the folder."""
    folder = _output_folder(folder)
    with _Staging(folder) as staging:
        for name, shards in ranks:
            for shard in shards:
                if len(shard.global_offset) != len(shard.local_shape):
                    raise StorageError(
                        f"{folder / name}: tensor '{shard.key}': global offset "
                        f"{list(shard.global_offset)} and local shape "
                        f"{list(shard.local_shape)} have different numbers of axes"
                    )
            info = {shard.key: {OFFSETS_KEY: list(shard.global_offset)} for shard in shards}
            specs = [TensorSpec(shard.key, shard.dtype, shard.local_shape) for shard in shards]
            metadata = {SHARDING_KEY: json.dumps(info), **_DCP_VERSION}
            with staging.file(name, specs, metadata) as writer:
                for shard in shards:
                    fill_shard(name, shard, writer.buffer(shard.key))
        return staging.commit()


class _Staging:
    """The files of one write call: each filled and finished in turn, then all renamed into
    place together. If anything fails (a fill, a rename), every file of the call is removed,
    partial or already renamed, so the folder holds nothing of the failed call; a file of the
    same name from an earlier run survives a failure before the renames, not one during."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.writers: list[SafetensorsWriter] = []

    @contextlib.contextmanager
    def file(
        self, name: str, tensors: Sequence[TensorSpec], metadata: dict[str, str] | None
    ) -> Iterator[SafetensorsWriter]:
        writer = SafetensorsWriter(self.folder / name, tensors, metadata)
        self.writers.append(writer)
        yield writer
        writer.finish()

    def commit(self) -> list[Path]:
        return [writer.commit() for writer in self.writers]

    def __enter__(self) -> _Staging:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:
            for writer in self.writers:
                writer.discard()


def _output_folder(folder: str | os.PathLike[str]) -> Path:
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


def _write_text(path: Path, text: str) -> None:
    """Write a small file atomically: a partial dot-file, fsync, rename."""
    partial = partial_path(path)
    try:
        with open(partial, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except OSError as error:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
        raise StorageError(f"{path}: cannot write: {error.strerror}") from error


def _remove(paths: Sequence[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
