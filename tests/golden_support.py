"""Golden-file helpers: shard layouts in a short form, and the printed form of each pass.

A case is `NAME.aoa` beside `NAME.json`:
    {"source": {"w": {"shape": [4, 8], "shards": 2, "axis": 1, "dtype": "float32"}},
     "destination": {...} or null, "reverse": false}
`shards`/`axis` default to 1/0 and `dtype` to float32. The expected text is `NAME.expected`;
run the tests with AOA_UPDATE_GOLDEN=1 to write it afresh (then read the diff).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sharding import sharded

from aoa.layout import ShardDesc


def shards(key: str, spec: dict) -> list[ShardDesc]:
    return sharded(key, spec["shape"], spec.get("shards", 1), spec.get("axis", 0),
                   spec.get("dtype", "float32"))


def layout(specs: dict | None) -> dict | None:
    if specs is None:
        return None
    return {key: shards(key, spec) for key, spec in specs.items()}


def load(path: Path) -> tuple[str, dict, dict | None, bool]:
    config = json.loads(path.with_suffix(".json").read_text())
    return (path.read_text(), layout(config["source"]), layout(config.get("destination")),
            bool(config.get("reverse")))


def compare(path: Path, text: str) -> None:
    expected = path.with_suffix(".expected")
    if os.environ.get("AOA_UPDATE_GOLDEN"):
        expected.write_text(text)
    assert expected.exists(), f"no {expected.name}; run with AOA_UPDATE_GOLDEN=1 and review it"
    assert text == expected.read_text()
