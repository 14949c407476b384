"""A Hugging Face index (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``):
the weight map of key -> file name beside a folder's files, read and checked alike for both
formats that carry one."""

from __future__ import annotations

from pathlib import Path

from aoa.errors import StorageError
from aoa.inputs import load_json, read_text


def read_index(index: Path) -> dict[str, str]:
    """The weight map of an index file, checked to be an object of key -> file name."""
    content = load_json(read_text(index, "index", StorageError), str(index), StorageError)
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(key, str) and isinstance(name, str) for key, name in weight_map.items()
    ):
        raise StorageError(f"{index}: index has no weight_map object of key -> file name")
    return weight_map


def index_files(index: Path, weight_map: dict[str, str]) -> list[Path]:
    """The files an index names, each checked to be a file beside it."""
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name != name:
            raise StorageError(f"{index}: file name '{name}' is not a name inside the folder")
        if not (index.parent / name).is_file():
            raise StorageError(f"{index}: names shard file '{name}', which does not exist")
    return [index.parent / name for name in names]
