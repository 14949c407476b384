"""The compiler as data: its passes in the order they run, from text to plan.

Each pass is a module with a ``NAME`` and ``run(ir, ctx) -> ir``; the IR changes form on
the way, and what a later pass needs travels in it, typed:

    parse             units of text            -> Program
    expand_macros     Program                  -> Program    templates, [a:b], *
    share_instances   Program                  -> Program    alike instances set aside
    resolve_chains    Program                  -> ChainedProgram  where each name's data goes
    expand_fused      ChainedProgram           -> Program    ^T, fused_ffn, fused_qkv(_old)
    propagate_shapes  Program                  -> SymbolicTensors  every output as pieces
    check_mapping     SymbolicTensors          -> SymbolicTensors  likely mistakes (strict)
    plan              SymbolicTensors          -> PlannedProgram   the copies per shard

`aoa.pipeline.analyze` runs them (or a part of them) with a hook after each pass.
"""

from __future__ import annotations

from typing import Any, Protocol

from aoa.passes import (
    check_mapping,
    expand_fused,
    expand_macros,
    parse,
    plan,
    propagate_shapes,
    resolve_chains,
    share_instances,
)
from aoa.passes.context import CompileContext


class Pass(Protocol):
    """A pass module: its name, and the function that runs it."""

    NAME: str

    def run(self, ir: Any, ctx: CompileContext) -> Any: ...


PIPELINE: tuple[Pass, ...] = (
    parse,
    expand_macros,
    share_instances,
    resolve_chains,
    expand_fused,
    propagate_shapes,
    check_mapping,
    plan,
)


def through(last: Pass, passes: tuple[Pass, ...] = PIPELINE) -> tuple[Pass, ...]:
    """The passes up to and including ``last``."""
    return passes[:passes.index(last) + 1]

