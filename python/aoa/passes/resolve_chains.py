"""Resolve chains: the data flow of every name, so a temporary can be traced back to the
source key it comes from and on to the destination key it reaches (spec 5.11).

The fused macros ask their shard counts through it: `w -> tmp, fused_ffn` then
`tmp^T -> dst` lays `tmp` out for the shards of `dst`. Unlike Paddle's last-record-wins
maps, the whole graph is followed (spec 0.4): every name is versioned at each write, so a
rebinding such as `t -> t, dtype=...` is an edge, not a loop, and a temporary read twice is
followed both ways (the ways must agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aoa.errors import ChainError
from aoa.ir import NOTHING, Program, Statement
from aoa.layout import shard_count
from aoa.passes.context import CompileContext

if TYPE_CHECKING:
    from aoa.printer import Printer

NAME = "resolve_chains"


@dataclass(frozen=True)
class Terminal:
    """Where a walk ended: a key of the source or destination (or nowhere known)."""

    key: str | None
    statement: Statement | None  # the statement through which the walk reached it


@dataclass
class DataFlow:
    """Versioned names over the statements in execution order (reverse mode: reversed and
    with sides swapped)."""

    statements: list[Statement]
    reverse: bool
    node_name: list[str] = field(default_factory=list)
    producer: list[int | None] = field(default_factory=list)
    consumers: list[list[int]] = field(default_factory=list)
    inputs: list[list[int]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    final: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, program: Program, reverse: bool) -> DataFlow:
        written = list(program.statements)
        order = list(reversed(range(len(written)))) if reverse else list(range(len(written)))
        flow = cls([written[i] for i in order], reverse)
        current: dict[str, int] = {}
        for executed, index in enumerate(order):
            statement = written[index]
            reads, writes = ((statement.right, statement.left) if reverse
                             else (statement.left, statement.right))
            read_nodes = []
            for name in reads:
                if name.base == NOTHING and len(reads) == 1:
                    continue
                node = current.get(name.base)
                if node is None:
                    node = current[name.base] = flow._new_node(name.base, None)
                flow.consumers[node].append(executed)
                read_nodes.append(node)
            write_nodes = []
            for name in writes:
                if name.base == NOTHING and len(writes) == 1:
                    continue
                node = current[name.base] = flow._new_node(name.base, executed)
                write_nodes.append(node)
            flow.inputs.append(read_nodes)
            flow.outputs.append(write_nodes)
        flow.final = current
        return flow

    def executed(self, index: int) -> int:
        """The position in execution order of the statement at ``index`` in the program."""
        return len(self.statements) - 1 - index if self.reverse else index

    def _new_node(self, name: str, producer: int | None) -> int:
        self.node_name.append(name)
        self.producer.append(producer)
        self.consumers.append([])
        return len(self.node_name) - 1

    def upstream(self, node: int) -> list[Terminal | Statement]:
        """Source-side ends of the flow into ``node``; a Statement marks a many-to-one step."""
        producer = self.producer[node]
        if producer is None:
            return [Terminal(self.node_name[node], None)]
        inputs = self.inputs[producer]
        if len(inputs) != 1:
            return [self.statements[producer]] if inputs else [Terminal(None, None)]
        return [end if not isinstance(end, Terminal) or end.statement else
                Terminal(end.key, self.statements[producer]) for end in self.upstream(inputs[0])]

    def downstream(self, node: int, destination_keys: frozenset[str]) -> list[Terminal | Statement]:
        """Destination-side ends of the flow out of ``node``."""
        name = self.node_name[node]
        ends: list[Terminal | Statement] = []
        if self.final.get(name) == node and name in destination_keys:
            ends.append(Terminal(name, None))
        for consumer in self.consumers[node]:
            outputs = self.outputs[consumer]
            if len(outputs) > 1:
                ends.append(self.statements[consumer])
            elif outputs:
                for end in self.downstream(outputs[0], destination_keys):
                    if isinstance(end, Terminal) and end.statement is None:
                        end = Terminal(end.key, self.statements[consumer])
                    ends.append(end)
        return ends or [Terminal(None, None)]


class Chains:
    """Answers the fused macros' question: over how many shards is this name laid out?"""

    def __init__(self, flow: DataFlow, ctx: CompileContext) -> None:
        self.flow = flow
        self.ctx = ctx

    def temporaries(self) -> list[tuple[str, list[str], list[str]]]:
        """(name, where its data comes from, where it goes) for every name a statement
        writes and a later one reads, in execution order; a name written several times is
        numbered (`t#2`)."""
        flow = self.flow
        versions: dict[str, int] = {}
        written: list[tuple[int, str]] = []
        for node, name in enumerate(flow.node_name):
            if flow.producer[node] is not None:
                versions[name] = versions.get(name, 0) + 1
                written.append((node, f"{name}#{versions[name]}"))
        rows = []
        for node, label in written:
            if not flow.consumers[node]:
                continue
            name = flow.node_name[node]
            rows.append((label if versions[name] > 1 else name,
                         _ends(flow.upstream(node)),
                         _ends(flow.downstream(node, self.ctx.destination_keys))))
        return rows

    def shard_count(self, index: int, name: str, *, left: bool) -> int:
        """Shards of ``name``, written on the ``left`` (or right) of the statement at
        ``index`` in the program.

        A name the statement reads is counted where its data comes from (the source
        checkpoint), one it writes where its data goes (the destination); in reverse mode
        the right side is read and the left written."""
        flow = self.flow
        executed = flow.executed(index)
        statement = flow.statements[executed]
        reads = left != flow.reverse
        info: dict | None
        if reads:
            read = next(n for n in flow.inputs[executed] if flow.node_name[n] == name)
            ends, info, what = flow.upstream(read), self.ctx.source, "source"
        else:
            written = next(n for n in flow.outputs[executed] if flow.node_name[n] == name)
            ends = flow.downstream(written, self.ctx.destination_keys)
            info, what = self.ctx.destination, "destination"
            if info is None:
                return 1
        counts: dict[int, Terminal] = {}
        ambiguous: Statement | None = None
        for end in ends:
            if isinstance(end, Statement):
                ambiguous = ambiguous or end
                continue
            if end.key is None:
                continue
            count, per_key = shard_count(info, end.key)
            if count is None and per_key:
                raise ChainError(
                    f"the {what} shards of '{end.key}' and its optimizer states disagree: "
                    + ", ".join(f"{k}: {v}" for k, v in per_key.items()), statement.span,
                    hint="Every optimizer state must be sharded like its parameter.")
            if count is not None:
                counts.setdefault(count, end)
        if len(counts) > 1:
            (a, first), (b, second) = list(counts.items())[:2]
            related = [(f"'{name}' reaches '{t.key}' ({n} shards) here", t.statement.span)
                       for n, t in ((a, first), (b, second)) if t.statement is not None]
            raise ChainError(
                f"'{name}' is laid out over {a} shards one way and {b} the other: its "
                f"{what} key is ambiguous", statement.span, related=related,
                hint="Give each fused layout its own temporary name.")
        if counts:
            return next(iter(counts))
        if ambiguous is not None:
            raise ChainError(
                f"cannot tell which {what} key '{name}' stands for: it flows through a "
                "statement with several names on the other side", statement.span,
                related=[("the many-to-one step", ambiguous.span)],
                hint="Route the fused tensor through one-to-one statements (renames, "
                     "transposes, casts) to its key.")
        if info:
            self.ctx.note(f"no {what} shards found for '{name}': laid out as one shard",
                          statement.span)
        return 1


def _ends(ends: list[Terminal | Statement]) -> list[str]:
    """How `temporaries` names the ends of a walk: a key, a step with several names on the
    other side, or nothing known."""
    texts = []
    for end in ends:
        if isinstance(end, Statement):
            where = end.span.location() if end.span else "?"
            text = f"several names at {where}"
        else:
            text = "nothing known" if end.key is None else f"'{end.key}'"
        if text not in texts:
            texts.append(text)
    return texts


@dataclass(frozen=True)
class ChainedProgram:
    """A program with its chains: what expand_fused reads to lay out the fused macros."""

    program: Program
    chains: Chains

    def print(self, printer: Printer) -> None:
        """The program, then each temporary with the keys its data comes from and goes to."""
        printer.print_program(self.program)
        rows = self.chains.temporaries()
        if rows:
            printer.line("# chains: where each temporary's data comes from and goes")
            for name, sources, destinations in rows:
                printer.line(f"{name}: from {', '.join(sources)}; to {', '.join(destinations)}")


def run(program: Program, ctx: CompileContext) -> ChainedProgram:
    return ChainedProgram(program, Chains(DataFlow.build(program, ctx.reverse), ctx))
