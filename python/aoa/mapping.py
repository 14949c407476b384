"""Mappings and shard descriptions as people hand them over: files, text, lists.

A mapping is AOA statements: a `.aoa` file, JSON (a list of statements, or Paddle's
``aoa_config`` with ``aoa_statements`` and ``aoa_config_reverse``), AOA text, or a list of
statement strings. Shard-info JSON maps keys to lists of shard descriptions. The command
line and `aoa.load` read them the same way, through here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

from aoa.errors import UsageError
from aoa.layout import ShardDesc


class MappingText(NamedTuple):
    """Statements to compile, the direction a file asks for, and its name for messages."""

    statements: str | list[str]
    reverse: bool = False
    file: str | None = None


def read_mapping(path: str | os.PathLike[str]) -> MappingText:
    """A `.aoa` file, or JSON: a list of statements or Paddle's aoa_config dict."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as error:
        raise UsageError(f"cannot read mapping {path}: {error.strerror}") from None
    if file.suffix != ".json":
        return MappingText(text, False, str(file))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(f"{path}:{error.lineno}:{error.colno}: not valid JSON: {error.msg}"
                         ) from None
    if isinstance(data, dict):
        return MappingText(list(data.get("aoa_statements", [])),
                           bool(data.get("aoa_config_reverse")), str(file))
    if isinstance(data, list) and all(isinstance(s, str) for s in data):
        return MappingText(data, False, str(file))
    raise UsageError(f"{path}: expected a list of statements or an object with "
                     "'aoa_statements'")


def as_mapping(mapping: object) -> MappingText:
    """A `.aoa` or JSON file (a path), AOA text (a string with `->` in it), or statements."""
    if isinstance(mapping, MappingText):
        return mapping
    if isinstance(mapping, (list, tuple)):
        return MappingText(list(mapping))
    if isinstance(mapping, str) and "->" in mapping:
        return MappingText(mapping)
    if isinstance(mapping, (str, os.PathLike)):
        return read_mapping(mapping)
    raise UsageError(f"mapping must be a file, AOA text or a list of statements, not "
                     f"{type(mapping).__name__}")


def read_shard_info(path: str | os.PathLike[str] | None, what: str
                    ) -> dict[str, list[ShardDesc]] | None:
    """Shard-info JSON: {key: [{key, local_shape, global_shape, global_offset, dtype}, ...]}."""
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise UsageError(f"cannot read {what} shard info {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"{path}:{error.lineno}:{error.colno}: not valid JSON: {error.msg}"
                         ) from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected an object mapping keys to lists of shards")
    try:
        return {key: [ShardDesc.from_json(s) for s in (shards if isinstance(shards, list)
                                                       else [shards])]
                for key, shards in data.items()}
    except (KeyError, TypeError, ValueError) as error:
        raise UsageError(f"{path}: a shard description needs key, local_shape, global_shape, "
                         f"global_offset and dtype ({error})") from None
