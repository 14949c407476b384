"""Mappings and shard descriptions as people hand them over: files, text, lists.

A mapping is AOA statements: a `.aoa` file, JSON (a list of statements, or Paddle's
``aoa_config`` with ``aoa_statements`` and ``aoa_config_reverse``), AOA text, or a list of
statement strings. Shard-info JSON maps keys to lists of shard descriptions. The command
line and `aoa.load` read them the same way, through here.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from aoa.collector import collector_paused
from aoa.errors import UsageError, quote
from aoa.inputs import load_json, read_text
from aoa.layout import ShardDesc, normalize_shard_info
from aoa.shard_info_json import ShardRows, read_regular_shard_info, regular_shard_rows


class MappingText(NamedTuple):
    """Statements to compile, the direction a file asks for, and its name for messages."""

    statements: str | list[str]
    reverse: bool = False
    file: str | None = None


def read_mapping(path: str | os.PathLike[str]) -> MappingText:
    """A `.aoa` file, or JSON: a list of statements or Paddle's aoa_config dict."""
    file = Path(path)
    text = read_text(file, "mapping")
    if file.suffix != ".json":
        return MappingText(text, False, str(file))
    data = load_json(text, str(path))
    if isinstance(data, dict):
        statements = data.get("aoa_statements", [])
        reverse = data.get("aoa_config_reverse", False)
        if not isinstance(reverse, bool):
            raise UsageError(f"{path}: aoa_config_reverse is {quote(reverse)}, not true or "
                             "false")
    else:
        statements, reverse = data, False
    if not isinstance(statements, list) or not all(isinstance(s, str) for s in statements):
        raise UsageError(f"{path}: expected a list of statements (texts) or an object with "
                         f"'aoa_statements' (a list of texts); found {quote(statements)}")
    return MappingText(statements, reverse, str(file))


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


@contextlib.contextmanager
def shard_info_read_aside(path: str | os.PathLike[str] | None, what: str
                          ) -> Iterator[Callable[[], dict[str, list[ShardDesc]] | None]]:
    """`read_shard_info` of ``path`` begun in a forked child (`aoa.forked`), for a block that
    does other work meanwhile (opens the source: one core each) and then calls the function
    given for the result. The child reads and checks text in `json.dumps`'s form and hands
    its rows over; any other text, a fault, or no child: the function reads it here, so the
    result and every error are those of `read_shard_info`, only later."""
    from aoa.forked import forked

    if path is None or not _worth_a_child(path):
        yield lambda: read_shard_info(path, what)
        return
    text_path = path

    def rows() -> ShardRows | None:
        return regular_shard_rows(read_text(text_path, f"{what} shard info"))

    with forked(rows) as pending:
        def result() -> dict[str, list[ShardDesc]] | None:
            found = None if pending is None else pending.result()
            if found is None:
                return read_shard_info(path, what)
            with collector_paused():
                return ShardDesc.grouped_unchecked(*found)

        yield result


def _worth_a_child(path: str | os.PathLike[str]) -> bool:
    from aoa.forked import WORTH_A_CHILD_BYTES

    try:
        return os.stat(path).st_size >= WORTH_A_CHILD_BYTES
    except OSError:
        return False  # (read where asked, which says what is wrong with it)


def read_shard_info(path: str | os.PathLike[str] | None, what: str
                    ) -> dict[str, list[ShardDesc]] | None:
    """Shard-info JSON: {key: [{key, local_shape, global_shape, global_offset, dtype}, ...]};
    in `json.dumps`'s form read without a JSON parser (`aoa.shard_info_json`), otherwise
    parsed and each description checked, whose errors name the file."""
    if path is None:
        return None
    with collector_paused():  # hundreds of thousands of objects, no cycles
        text = read_text(path, f"{what} shard info")
        info = read_regular_shard_info(text)
        if info is not None:
            return info
        data = load_json(text, str(path))
        if not isinstance(data, dict):
            raise UsageError(f"{path}: expected an object mapping keys to lists of shards")
        try:
            return normalize_shard_info(data, what)
        except UsageError as error:
            raise UsageError(f"{path}: {error.message}", hint=error.hint) from None


def read_source(path: str | os.PathLike[str], format: str | None = None
                ) -> tuple[dict[str, list[ShardDesc]], Path | None]:
    """The source shards of `--source`: shard-info JSON, or a checkpoint of any format aoa
    reads (a folder, a file, a Hugging Face index), opened for its shard descriptions; and
    the checkpoint's path (None for shard-info JSON), where a record may lie beside it."""
    from aoa.storage.formats import open_source

    path = Path(path)
    if format is None and path.suffix == ".json" and not path.name.endswith(".index.json") \
            and not path.is_dir():
        return read_shard_info(path, "source") or {}, None
    if not path.exists():
        raise UsageError(f"cannot read source {path}: no such file or folder")
    with open_source(path, format) as checkpoint:
        return checkpoint.shards, checkpoint.path
