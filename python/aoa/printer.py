"""The printer: one text form for every stage of a compilation, for people and golden files.

Statements print as AOA text with where they were written (and through which macros),
symbolic tensors as their pieces, plans as the copies of each destination shard. `aoa
explain`, `--print-after`, the golden tests of every pass and `Plan.describe` all print
through it, so a box or a step reads the same everywhere. Like xDSL's Printer it writes to
a stream and offers its primitives to IR forms that print themselves (`print_ir`).
"""

from __future__ import annotations

import io
from collections.abc import Container, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TextIO, runtime_checkable

from aoa.ir import Program, Statement
from aoa.symbolic import Permute, SymbolicTensors, Tensor

if TYPE_CHECKING:
    from aoa.layout import ShardDesc
    from aoa.plan import Plan


@runtime_checkable
class Printable(Protocol):
    """An IR form of a pass that prints itself with the printer's primitives."""

    def print(self, printer: Printer) -> None: ...


def region(lo: Iterable[int], hi: Iterable[int]) -> str:
    """``0:4, 2:6`` for the box [lo, hi)."""
    return ", ".join(f"{a}:{b}" for a, b in zip(lo, hi))


def shard_region(shard: ShardDesc) -> str:
    """The global box a shard covers, as `region` prints it."""
    return ", ".join(f"{o}:{o + n}" for o, n in zip(shard.global_offset, shard.local_shape))


class Printer:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def line(self, text: str = "") -> None:
        self.stream.write(text + "\n")

    def print_ir(self, ir: object) -> None:
        """Whatever a pass left: a program, symbolic tensors, or a pass's own form that
        prints itself with the primitives below (resolve_chains', the plan pass's)."""
        if isinstance(ir, Program):
            self.print_program(ir)
        elif isinstance(ir, SymbolicTensors):
            self.print_tensors(ir)
        elif isinstance(ir, Printable):
            ir.print(self)
        else:
            raise TypeError(f"cannot print a {type(ir).__name__}")

    # -- statements ------------------------------------------------------------------------
    def print_statement(self, statement: Statement) -> None:
        """The statement, then where its written statement is and the macros that made it."""
        written = statement.written()
        where = written.span.location() if written.span else "?"
        steps = [macro for macro, _ in statement.expansion()]
        via = f" via {', '.join(steps)}" if steps else ""
        self.line(f"{statement}  [{where}{via}]")

    def print_program(self, program: Program) -> None:
        for statement in program.statements:
            self.print_statement(statement)
        for group in program.shared:
            self.line(f"# compiled as `{group.kept}`:")
            for follower in group.followers:
                self.print_statement(follower.statement)

    # -- symbolic tensors ------------------------------------------------------------------
    def print_tensor(self, key: str, tensor: Tensor | None,
                     removed: Container[str] = ()) -> None:
        """A destination key's tensor: its shape and source dtype, then its pieces in order,
        each `[box of the tensor] <- source key[box]  (steps)`."""
        if tensor is None:
            self.line(f"{key}: declared empty (`_ -> {key}`), left as it is")
            return
        self.line(f"{key}: shape {list(tensor.shape)}, source dtype {tensor.dtype}")
        for source_key, piece in tensor.pieces():
            steps = "; ".join(op.text if isinstance(op, Permute) else f"cast {op}"
                              for op in piece.ops)
            suffix = f"  ({steps})" if steps else ""
            deleted = "  (deleted by `-> _`)" if source_key in removed else ""
            self.line(f"    [{region(piece.target_lo, piece.target_hi)}] <- "
                      f"{source_key}[{region(piece.source_lo, piece.source_hi)}]"
                      f"{suffix}{deleted}")

    def print_tensors(self, tensors: SymbolicTensors) -> None:
        for key, tensor in tensors.outputs.items():
            self.print_tensor(key, tensor, tensors.removed)

    # -- plans -----------------------------------------------------------------------------
    def print_plan(self, plan: Plan) -> None:
        """One block per destination shard: where each of its regions comes from."""
        self.line(f"plan: {len(plan.sources)} source shards -> {len(plan.destinations)} "
                  f"destination shards, {len(plan.copies)} copies, "
                  f"{plan.destination_bytes():,} bytes")
        grouped = plan.copies_by_destination()
        untouched = set(plan.untouched)
        for index, destination in enumerate(plan.destinations):
            self.line(f"{destination.key}[{shard_region(destination)}] of "
                      f"{list(destination.global_shape)}  {destination.dtype or '-'}")
            if index in untouched:
                self.line("    (left as it is: declared with `_ -> key`)")
            for copy in grouped[index]:
                source = plan.sources[copy.source]
                source_region = ", ".join(
                    f"{o + a}:{o + a + n}" for o, a, n in
                    zip(source.global_offset, copy.source_start, copy.source_shape))
                steps = []
                if copy.order is not None:
                    steps.append(f"permute {list(copy.order)}")
                scale = plan.scale_of(copy)
                if scale is not None:
                    steps.append(f"times the scales of '{plan.sources[scale.scale].key}' per "
                                 f"block of {' x '.join(map(str, scale.block))}")
                steps += [f"round to {d}" for d in copy.casts]
                if (source.dtype or "float32") != (destination.dtype or "float32"):
                    steps.append(f"cast {source.dtype} -> {destination.dtype}")
                extra = f"  ({'; '.join(steps)})" if steps else ""
                target = ", ".join(f"{a}:{a + n}"
                                   for a, n in zip(copy.destination_start, copy.shape))
                self.line(f"    [{target}] <- {source.key}[{source_region}]{extra}")

    def print_notes(self, notes: Sequence[str]) -> None:
        if notes:
            self.line("# notes")
            for note in notes:
                self.line(note)


def to_text(ir: object) -> str:
    """What `Printer.print_ir` writes for ``ir``."""
    out = io.StringIO()
    Printer(out).print_ir(ir)
    return out.getvalue()
