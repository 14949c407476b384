"""aoa: compile AOA checkpoint mappings into plans, and execute them."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from aoa.errors import (
    AoaError,
    AoaSyntaxError,
    ChainError,
    ExecutionError,
    MacroError,
    PlanError,
    ShapeError,
    StorageError,
    UsageError,
    ValidationError,
)

if TYPE_CHECKING:
    from aoa.jobs.load import Shard, load
    from aoa.layout import ShardDesc
    from aoa.pipeline import compile
    from aoa.plan import Plan, PlannedCopy

#: imported when first used: the compiler needs Lark, loading needs numpy and the kernel,
#: and a command such as `aoa --help` needs none of them
_LAZY = {"compile": "aoa.pipeline", "load": "aoa.jobs.load", "Shard": "aoa.jobs.load",
         "ShardDesc": "aoa.layout", "Plan": "aoa.plan", "PlannedCopy": "aoa.plan"}

__all__ = [
    "AoaError", "AoaSyntaxError", "ChainError", "ExecutionError", "MacroError", "Plan",
    "PlanError", "PlannedCopy", "ShapeError", "Shard", "ShardDesc", "StorageError", "UsageError",
    "ValidationError", "compile", "load",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        # a submodule (`aoa.pipeline`), found as when importing aoa imported them all
        if name.startswith("_") or importlib.util.find_spec(f"aoa.{name}") is None:
            raise AttributeError(f"module 'aoa' has no attribute {name!r}")
        return importlib.import_module(f"aoa.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
