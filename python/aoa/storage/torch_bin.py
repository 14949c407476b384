"""The ``bin`` format (read only): ``pytorch_model.bin``, or the files a
``pytorch_model.bin.index.json`` names, each a ``torch.save`` of a state dict.

Read without torch (`aoa.storage.torch_save`, and `aoa.storage.torch_legacy` for files in
the format before PyTorch 1.6): every tensor is whole (global offset zeros),
its bytes in place in the file's mapping; a tensor stored as a strided view of a larger
storage (a transposed weight, tied weights) is honoured, and one that is not C-contiguous is
gathered into C order when read. Nested dicts give dotted keys; values that are not tensors
(a step count) are not read. An index's ``weight_map`` must agree with the files: each key
it names is in the file it names, and each tensor stored is named, with its file.
"""

from __future__ import annotations

from pathlib import Path

from aoa.errors import StorageError
from aoa.layout import ShardDesc
from aoa.storage.formats import Format
from aoa.storage.hf_index import index_files, read_index
from aoa.storage.mapped import MappedFiles, MappedSource, Stored
from aoa.storage.torch_legacy import is_legacy, read_legacy
from aoa.storage.torch_save import SavedTensor, read_torch_save, stored

SINGLE_NAME = "pytorch_model.bin"
INDEX_NAME = "pytorch_model.bin.index.json"
_SUFFIXES = (".bin", ".pt", ".pth")


class TorchBinSource(MappedSource):
    """Open ``torch.save`` files of whole tensors."""

    def __init__(self, path: Path, files: MappedFiles,
                 stored: dict[str, list[tuple[ShardDesc, Stored]]]) -> None:
        super().__init__(path, "bin", stored)
        self._files = files

    def files(self) -> list[Path]:
        return sorted(self._files.files)


def claims(path: Path) -> bool:
    """A ``.bin``/``.pt`` file that is a zip archive or in the legacy format, or a folder
    with ``pytorch_model.bin`` or its index."""
    if path.is_file():
        if path.suffix not in _SUFFIXES:
            return False
        with open(path, "rb") as file:
            head = file.read(32)
        return head[:4] == b"PK\x03\x04" or is_legacy(head)
    return path.is_dir() and ((path / SINGLE_NAME).is_file() or (path / INDEX_NAME).is_file())


def open_bin(path: Path) -> TorchBinSource:
    """Open a ``torch.save`` file, or a folder of ``pytorch_model.bin`` files."""
    weight_map = None
    if path.is_file():
        names = [path]
    elif (path / INDEX_NAME).is_file():
        weight_map = read_index(path / INDEX_NAME)
        names = index_files(path / INDEX_NAME, weight_map)
    elif (path / SINGLE_NAME).is_file():
        names = [path / SINGLE_NAME]
    else:
        raise StorageError(f"{path}: no {SINGLE_NAME} or {INDEX_NAME} in this folder"
                           if path.is_dir() else f"{path}: no such checkpoint file or folder")
    files = MappedFiles()
    try:
        found: dict[str, list[tuple[ShardDesc, Stored]]] = {}
        found_in: dict[str, Path] = {}
        for name in names:
            mapped = files.open(name)
            state = (read_legacy(mapped.data, name) if is_legacy(bytes(mapped.data[:32]))
                     else read_torch_save(mapped.data, name))
            if not isinstance(state, dict):
                raise StorageError(f"{name}: holds a {type(state).__name__}, not a state dict")
            for key, tensor in _flat(state):
                if key in found_in:
                    raise StorageError(f"tensor '{key}' is in both {found_in[key]} and {name}")
                found_in[key] = name
                shard = ShardDesc.full(key, tensor.shape, tensor.dtype)
                found[key] = [(shard, stored(tensor, mapped))]
        if weight_map is not None:
            _check_index(path / INDEX_NAME, weight_map, found_in)
        return TorchBinSource(path, files, found)
    except BaseException:
        files.close()
        raise


def _flat(state: dict, prefix: str = "") -> list[tuple[str, SavedTensor]]:
    found: list[tuple[str, SavedTensor]] = []
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, SavedTensor):
            found.append((name, value))
        elif isinstance(value, dict):
            found += _flat(value, f"{name}.")
    return found


def _check_index(index: Path, weight_map: dict[str, str], found_in: dict[str, Path]) -> None:
    """Each key the index names is in the file it names, and each tensor stored is named:
    an index that disagrees with its files is a checkpoint assembled from two saves."""
    for key, name in weight_map.items():
        if found_in.get(key) != index.parent / name:
            raise StorageError(f"{index}: says tensor '{key}' is in '{name}', which does not "
                               "hold it")
    for key, path in found_in.items():
        if key not in weight_map:
            raise StorageError(f"{path}: tensor '{key}' is not in the index {index}")


FORMAT = Format("bin", "pytorch_model.bin (torch.save state dicts), read only", claims,
                open_bin, None)
