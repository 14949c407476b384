"""The compiler driver: text -> IR -> passes -> Plan, the passes of `aoa.passes.PIPELINE`
run in order.

`after_pass(name, ir, ctx, seconds)` is called after each one: `aoa explain --print-after`
and `--time-passes` are such hooks, and tests use one to check what each pass leaves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aoa.collector import collector_paused
from aoa.ir import Program
from aoa.layout import BETA_POW_SUFFIXES, OPTIMIZER_SUFFIXES, ShardDesc, normalize_shard_info
from aoa.passes import PIPELINE, Pass
from aoa.passes.context import CompileContext
from aoa.passes.parse import texts
from aoa.passes.plan import PlannedProgram, Planner, destination_shards, output_dtype
from aoa.plan import Plan
from aoa.symbolic import SymbolicTensors, dtype_after

if TYPE_CHECKING:
    from aoa.record import FusedRecord

AfterPass = Callable[[str, Any, CompileContext, float], None]


@dataclass
class Compilation:
    """What the compiler knows after the passes: the symbolic tensors of the outputs and,
    when the plan pass ran, the plan of every destination shard."""

    ctx: CompileContext
    tensors: SymbolicTensors
    #: the plan pass's plan of every destination shard (None: the pipeline stopped before)
    planned: Plan | None = None

    @property
    def program(self) -> Program:
        """The statements after expansion, the ones that made the tensors."""
        return self.tensors.program

    def plan(self, targets: Sequence[ShardDesc] | None = None) -> Plan:
        """The plan of every destination shard, or of ``targets`` (any boxes of outputs)."""
        if targets is None and self.planned is not None:
            return self.planned
        with collector_paused():
            plan = Planner(self.tensors, self.ctx).plan(targets)
        if targets is None:
            self.planned = plan
        return plan

    def destination_shards(self) -> list[ShardDesc]:
        """The declared destination shards, or without a destination every output whole."""
        return destination_shards(self.tensors, self.ctx)

    def outputs(self) -> dict[str, ShardDesc | None]:
        """Every tensor the program makes, whole, by key (global shape, and the dtype its
        casts make); None for a key declared with `_ -> key` (left as it is). Without a
        destination: what a mapping makes on its own."""
        made = {shard.key: shard for shard in self.destination_shards()}
        return {key: made.get(key) for key in self.tensors.outputs}

    def made_as(self, key: str) -> ShardDesc | None:
        """What ``key`` gets, whole, when a destination names it (spec 6.6): the tensor a
        statement last wrote to that name, else the source key of that name; None for a key
        declared with `_ -> key`. A KeyError when it is neither. Asked of a compile without
        a destination, where no instance was set aside, so every name written is bound."""
        tensors = self.tensors
        tensor = tensors.bound.get(key)
        if tensor is None:
            if key in tensors.added:
                return None
            tensor = tensors.inputs.get(key)
            if tensor is None:
                raise KeyError(key)
        return ShardDesc.full(key, tensor.shape, output_dtype(key, tensor))

    def derived_outputs(self) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """Key -> (global shape, dtype) of every output the program makes when no
        destination is given, with the optimizer states that follow it: a state that
        every source of the output has (a mesh layout is applied to these)."""
        source = self.ctx.source
        made = self.tensors.outputs
        outputs = {}
        for target in self.destination_shards():
            outputs[target.key] = (target.global_shape, target.dtype)
            tensor = made[target.key]
            if tensor is None:
                continue
            keys = sorted(tensor.source_keys())
            for suffix in OPTIMIZER_SUFFIXES:
                if not keys or not all(key + suffix in source for key in keys):
                    continue
                if suffix in BETA_POW_SUFFIXES:
                    first = source[keys[0] + suffix][0]
                    outputs[target.key + suffix] = (first.global_shape, first.dtype)
                    continue
                dtypes = {dtype_after(piece.ops, source[key + suffix][0].dtype)
                          for key, piece in tensor.pieces()}
                if len(dtypes) == 1:
                    outputs[target.key + suffix] = (target.global_shape, dtypes.pop())
        return outputs


def new_context(source: Mapping, destination: Mapping | None = None, reverse: bool = False,
                *, strict: bool = False, fused: FusedRecord | None = None) -> CompileContext:
    """The context of one compile: the shard descriptions (ShardDesc, Paddle's descriptors
    or JSON dicts), checked, the direction, and how strict to be (`CompileContext`)."""
    return CompileContext(normalize_shard_info(source, "source") or {},
                          normalize_shard_info(destination, "destination"), reverse,
                          strict=strict, fused=fused)


def run_passes(ir: Any, ctx: CompileContext, passes: Sequence[Pass],
               after_pass: AfterPass | None = None) -> Any:
    """``ir`` through each of ``passes`` in turn, calling ``after_pass`` after each."""
    with collector_paused():
        for compiler_pass in passes:
            start = time.perf_counter()
            ir = compiler_pass.run(ir, ctx)
            if after_pass is not None:
                after_pass(compiler_pass.NAME, ir, ctx, time.perf_counter() - start)
    return ir


def analyze(statements: str | Sequence[str], source: Mapping, destination: Mapping | None = None,
            *, reverse: bool = False, file: str | None = None,
            passes: Sequence[Pass] = PIPELINE, after_pass: AfterPass | None = None,
            strict: bool = False, fused: FusedRecord | None = None) -> Compilation:
    """Run ``passes`` (by default all, planning every destination shard) over the program.

    ``passes`` may leave out share_instances (every template instance expanded in full) and
    stop after propagate_shapes (nothing planned until asked); they start with parse.
    ``strict`` and ``fused``: see `CompileContext`."""
    with collector_paused():
        ctx = new_context(source, destination, reverse, strict=strict, fused=fused)
    return compile_in(ctx, statements, file=file, passes=passes, after_pass=after_pass)


def compile_in(ctx: CompileContext, statements: str | Sequence[str], *, file: str | None = None,
               passes: Sequence[Pass] = PIPELINE, after_pass: AfterPass | None = None
               ) -> Compilation:
    """`analyze` in a context made already (`new_context`)."""
    result = run_passes(texts(statements, file=file), ctx, passes, after_pass)
    if isinstance(result, PlannedProgram):
        return Compilation(ctx, result.tensors, result.plan)
    if not isinstance(result, SymbolicTensors):
        raise TypeError(f"the passes end with a {type(result).__name__}; a compilation runs "
                        "them at least through propagate_shapes")
    return Compilation(ctx, result)


def compile(statements: str | Sequence[str], source: Mapping[str, Sequence[ShardDesc]],
            destination: Mapping[str, Sequence[ShardDesc]] | None = None, *,
            reverse: bool = False, file: str | None = None, strict: bool = False) -> Plan:
    """Compile AOA statements into a validated Plan.

    ``statements`` is the text of a `.aoa` file or Paddle's list of statement strings;
    ``source`` and ``destination`` map keys to shard descriptions (``destination=None``:
    derive the outputs, as Paddle's full export does); ``reverse`` runs the program
    backwards (Paddle's ``aoa_config_reverse``). ``strict`` refuses likely mistakes that
    Paddle runs (`CompileContext`); the compiler alone keeps Paddle's meaning by default,
    the jobs (`aoa.load`, `aoa convert`) are strict by default."""
    return analyze(statements, source, destination, reverse=reverse, file=file,
                   strict=strict).plan()
