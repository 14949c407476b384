"""aoa: compile AOA checkpoint mappings into plans, and execute them."""

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
from aoa.jobs.load import Shard, load
from aoa.layout import ShardDesc
from aoa.pipeline import compile
from aoa.plan import Plan, PlannedCopy

__all__ = [
    "AoaError", "AoaSyntaxError", "ChainError", "ExecutionError", "MacroError", "Plan",
    "PlanError", "PlannedCopy", "ShapeError", "Shard", "ShardDesc", "StorageError", "UsageError",
    "ValidationError", "compile", "load",
]
