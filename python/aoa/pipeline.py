"""The compiler: text -> IR -> passes -> Plan, as a tuple of passes run in order.

Each pass is `run(program, ctx) -> program`; `after_pass` is called after each one
(for `--print-after`, `--time-passes` and invariant checks in tests).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from aoa.ir import Program
from aoa.layout import BETA_POW_SUFFIXES, OPTIMIZER_SUFFIXES, ShardDesc, normalize_shard_info
from aoa.passes import (
    expand_fused,
    expand_macros,
    propagate_shapes,
    resolve_chains,
    share_instances,
)
from aoa.passes.context import CompileContext
from aoa.passes.parse import parse
from aoa.passes.plan import Planner, result_dtype
from aoa.plan import Plan

PASSES: tuple[tuple[str, Callable[[Program, CompileContext], Program]], ...] = (
    ("expand_macros", expand_macros.run),
    ("share_instances", share_instances.run),
    ("resolve_chains", resolve_chains.run),
    ("expand_fused", expand_fused.run),
    ("propagate_shapes", propagate_shapes.run),
)

AfterPass = Callable[[str, Program, CompileContext], None]


@dataclass
class Compilation:
    """Everything the compiler knows after the passes: the expanded program and the planner."""

    written: Program
    program: Program
    ctx: CompileContext
    planner: Planner

    def plan(self, targets: Sequence[ShardDesc] | None = None) -> Plan:
        with _collector_paused():
            return self.planner.plan(targets)

    def outputs(self) -> dict[str, ShardDesc | None]:
        """Every tensor the program makes, whole, by key (global shape, and the dtype its
        casts make); None for a key declared with `_ -> key` (left as it is)."""
        made = {target.key: target for target in self.planner.targets()}
        return {key: made.get(key) for key in self.planner.state.outputs}

    def derived_outputs(self) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """Key -> (global shape, dtype) of every output the program makes when no
        destination is given, with the optimizer states that follow it: a state that
        every source of the output has (a shard layout is derived from these)."""
        source = self.ctx.source
        outputs = {}
        for target in self.planner.targets():
            outputs[target.key] = (target.global_shape, target.dtype)
            tensor = self.planner.state.outputs[target.key]
            if tensor is None:  # not a target: declared with `_ -> key`
                continue
            keys = sorted(tensor.source_keys())
            for suffix in OPTIMIZER_SUFFIXES:
                if not keys or not all(key + suffix in source for key in keys):
                    continue
                if suffix in BETA_POW_SUFFIXES:
                    first = source[keys[0] + suffix][0]
                    outputs[target.key + suffix] = (first.global_shape, first.dtype)
                    continue
                dtypes = {result_dtype(piece.ops, source[key + suffix][0].dtype)
                          for key, piece in tensor.pieces()}
                if len(dtypes) == 1:
                    outputs[target.key + suffix] = (target.global_shape, dtypes.pop())
        return outputs


@contextlib.contextmanager
def _collector_paused():
    """The passes allocate millions of small tuples and free few: pausing the cyclic garbage
    collector halves compile time on big models (nothing here makes reference cycles that
    outlive the call)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def analyze(statements: str | Sequence[str], source: Mapping, destination: Mapping | None = None,
            *, reverse: bool = False, file: str | None = None,
            after_pass: AfterPass | None = None, share: bool = True) -> Compilation:
    """Run every pass; the result can answer queries (compat engine) or build the plan.

    ``share=False`` expands every template instance in full (for `aoa explain`)."""
    with _collector_paused():
        ctx = CompileContext(normalize_shard_info(source, "source") or {},
                             normalize_shard_info(destination, "destination"), reverse)
        written = parse(statements, file=file)
        program = written
        if after_pass:
            after_pass("parse", program, ctx)
        for name, run in PASSES:
            if name == "share_instances" and not share:
                ctx.facts["shared"] = []
                continue
            program = run(program, ctx)
            if after_pass:
                after_pass(name, program, ctx)
    return Compilation(written, program, ctx, Planner(ctx))


def compile(statements: str | Sequence[str], source: Mapping[str, Sequence[ShardDesc]],
            destination: Mapping[str, Sequence[ShardDesc]] | None = None, *,
            reverse: bool = False, file: str | None = None) -> Plan:
    """Compile AOA statements into a validated Plan.

    ``statements`` is the text of a `.aoa` file or Paddle's list of statement strings;
    ``source`` and ``destination`` map keys to shard descriptions (``destination=None``:
    derive the outputs, as Paddle's full export does); ``reverse`` runs the program
    backwards (Paddle's ``aoa_config_reverse``)."""
    with _collector_paused():
        return analyze(statements, source, destination, reverse=reverse, file=file).plan()
