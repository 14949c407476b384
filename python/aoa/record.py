"""The record a model conversion leaves beside its checkpoint (`aoa-conversion.json`), and
what it tells a later job: which tensors are stored fused, in a layout that depends on the
degree they were written at.

`aoa convert --to paddleformers` (aoa.models) writes the record: family, target, mesh,
dtype, the exact mapping text and more. Its mapping says what is fused: a statement with
`fused_ffn`, `fused_qkv_old` or `fused_in_proj` lays the tensor it writes out by its shard
count (`[gate_r | up_r]` on each rank r), so such a tensor keeps its meaning only at that
count, or when a statement with the same macro lays it out again. (`fused_qkv`'s grouped
layout is the same whole tensor at any shard count, so it is not recorded as fused here.)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aoa.errors import AoaError, StorageError
from aoa.inputs import load_json, read_text
from aoa.ir import SHARD_COUNT_FLAGS, format_value
from aoa.passes.parse import parse_source
from aoa.source import SourceText

#: The record's file name, in the folder of the checkpoint it describes.
RECORD = "aoa-conversion.json"
#: What every record holds.
RECORD_FIELDS = ("family", "target", "mesh", "mapping", "source_dtypes")

_PLACEHOLDER = re.compile(r"\$LAYER_ID_OFFSET|\$LAYER_ID|\$EXPERT_ID")


def read_record(folder: Path) -> dict[str, Any] | None:
    """The record in ``folder`` (None: there is none); a StorageError naming the file when it
    is not one."""
    path = folder / RECORD
    if not path.is_file():
        return None
    record = load_json(read_text(path, "record", StorageError), str(path), StorageError)
    if not isinstance(record, dict):
        raise StorageError(f"{path}: the record is not a JSON object")
    for name in RECORD_FIELDS:
        if name not in record:
            raise StorageError(f"{path}: the record lacks '{name}'")
    if not isinstance(record["mapping"], str):
        raise StorageError(f"{path}: the record's mapping is not AOA text")
    return record


@dataclass(frozen=True)
class FusedTensor:
    """Keys written by one statement of the recorded mapping with a per-shard macro."""

    template: str  # the name as the mapping writes it (with $LAYER_ID ...)
    pattern: re.Pattern[str]
    macro: str
    #: the macro's other attributes as written (`num_heads=8, num_key_value_groups=2`)
    attributes: str

    def statement(self, key: str) -> str | None:
        """The statement that re-lays ``key`` at the destination's shard count (None: its
        macro cannot, as `fused_in_proj`, whose parts may differ in size)."""
        if self.macro == "fused_in_proj":
            return None
        extra = f", {self.attributes}" if self.attributes else ""
        return f"{key} -> {key}, {self.macro}{extra}"


@dataclass(frozen=True)
class FusedRecord:
    """What a record says is stored fused, by key."""

    path: str  # the record file, for messages
    tensors: tuple[FusedTensor, ...]

    def find(self, key: str) -> FusedTensor | None:
        return next((t for t in self.tensors if t.pattern.fullmatch(key)), None)


def fused_record(folder: Path) -> FusedRecord | None:
    """What the record in ``folder`` says is fused (None: no record, or nothing fused)."""
    record = read_record(folder)
    if record is None:
        return None
    path = folder / RECORD
    fused = fused_tensors(record, str(path))
    return FusedRecord(str(path), fused) if fused else None


def source_record(path: Path) -> FusedRecord | None:
    """What the record beside the checkpoint at ``path`` (its folder, or a file in it) says
    is fused."""
    return fused_record(path if path.is_dir() else path.parent)


def fused_tensors(record: Mapping[str, Any], where: str) -> tuple[FusedTensor, ...]:
    """The names the record's mapping writes with a per-shard macro (its forward direction:
    the right of '->')."""
    try:
        statements = parse_source(SourceText(f"{where} (mapping)", record["mapping"]))
    except AoaError as error:
        raise StorageError(f"{where}: the record's mapping is not valid AOA: "
                           f"{error.message}") from None
    found: dict[str, FusedTensor] = {}
    for statement in statements:
        macros = [a.key for a in statement.attributes if a.key in SHARD_COUNT_FLAGS]
        if not macros or len(statement.right) != 1:
            continue
        attributes = ", ".join(f"{a.key}={format_value(a.value)}" for a in statement.attributes
                               if a.key in ("num_heads", "num_key_value_groups", "axis"))
        for name in statement.right:
            template = name.base
            found.setdefault(template, FusedTensor(template, _pattern(template), macros[0],
                                                   attributes))
    return tuple(found.values())


def _pattern(template: str) -> re.Pattern[str]:
    parts = _PLACEHOLDER.split(template)
    return re.compile(r"\d+".join(re.escape(part) for part in parts))
