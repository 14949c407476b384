"""Golden fixtures: one file per pass, `tests/golden/passes/<pass>.txt`, many cases each.

A case runs the pipeline through that pass and prints what the pass left (aoa.printer), or
the error it raised::

    === case_name
    --- mapping
    w^T -> v
    --- shards
    {"source": {"w": {"shape": [4, 8], "shards": 2, "axis": 1, "dtype": "float32"}},
     "destination": {...} or null, "reverse": false, "strict": false,
     "record": "mapping text of the source's record (what it stores fused)" or absent}
    --- expected
    w -> w_transpose_tmp, permute='[]'  [case_name.aoa:1:1 via transpose]
    ...

In the shards, `shards`/`axis` default to 1/0 and `dtype` to float32; the mapping is read
as the file `case_name.aoa`. Run the tests with AOA_UPDATE_GOLDEN=1 to write the expected
sections afresh (then read the diff).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from sharding import sharded

from aoa.layout import ShardDesc
from aoa.record import FusedRecord, fused_tensors

CASE, SECTION = "=== ", "--- "
SECTIONS = ("mapping", "shards", "expected")


def shards(key: str, spec: dict) -> list[ShardDesc]:
    return sharded(key, spec["shape"], spec.get("shards", 1), spec.get("axis", 0),
                   spec.get("dtype", "float32"))


def layout(specs: dict | None) -> dict | None:
    if specs is None:
        return None
    return {key: shards(key, spec) for key, spec in specs.items()}


@dataclass
class Case:
    name: str
    mapping: str
    shards: str  # the JSON text, kept as written
    expected: str

    @property
    def file(self) -> str:
        return f"{self.name}.aoa"

    def config(self) -> tuple[dict, dict | None, bool]:
        """(source, destination, reverse)."""
        config = json.loads(self.shards)
        return (layout(config["source"]) or {}, layout(config.get("destination")),
                bool(config.get("reverse")))

    def strictness(self) -> tuple[bool, FusedRecord | None]:
        """Whether the case runs strict, and what its source's record says is fused (the
        shards' "record": the mapping text a model conversion recorded)."""
        config = json.loads(self.shards)
        record = config.get("record")
        fused = (FusedRecord("record.json", fused_tensors({"mapping": record}, "record.json"))
                 if record is not None else None)
        return bool(config.get("strict")), fused


def read_cases(path: Path) -> list[Case]:
    cases: list[Case] = []
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    name = None

    def finish() -> None:
        if name is not None:
            cases.append(Case(name, *("\n".join(sections.get(s, [])).strip("\n") + "\n"
                                      for s in SECTIONS)))

    for line in path.read_text().splitlines():
        if line.startswith(CASE):
            finish()
            name, sections, current = line[len(CASE):].strip(), {}, None
        elif line.startswith(SECTION):
            section = line[len(SECTION):].strip()
            assert section in SECTIONS, f"{path}: unknown section {section!r}"
            current = sections[section] = []
        elif current is not None:
            current.append(line)
        else:
            assert not line.strip(), f"{path}: text outside a section: {line!r}"
    finish()
    return cases


def write_cases(path: Path, cases: list[Case]) -> None:
    blocks = [f"{CASE}{c.name}\n{SECTION}mapping\n{c.mapping}{SECTION}shards\n{c.shards}"
              f"{SECTION}expected\n{c.expected}" for c in cases]
    path.write_text("\n".join(blocks))


def compare(path: Path, case: Case, actual: str) -> None:
    """``actual`` against the case's expected text; with AOA_UPDATE_GOLDEN=1 it becomes the
    expected text in the file."""
    actual = actual.strip("\n") + "\n"
    if os.environ.get("AOA_UPDATE_GOLDEN"):
        cases = read_cases(path)
        for other in cases:
            if other.name == case.name:
                other.expected = actual
        write_cases(path, cases)
        return
    assert actual == case.expected
