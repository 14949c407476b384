"""Resolve chains: the data flow of every name, so a temporary can be traced back to the
source key it comes from and on to the destination key it reaches (spec 5.11).

The fused macros ask their shard counts through it: `w -> tmp, fused_ffn` then
`tmp^T -> dst` lays `tmp` out for the shards of `dst`. Unlike Paddle's last-record-wins
maps, the whole graph is followed (spec 0.4): every name is versioned at each write, so a
rebinding such as `t -> t, dtype=...` is an edge, not a loop, and a temporary read twice,
split or concatenated is followed every way (the ways must agree).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aoa.errors import ChainError
from aoa.ir import FLAG_ATTRIBUTES, NOTHING, PER_SHARD_FLAGS, Program, Statement
from aoa.layout import shard_count
from aoa.passes.context import CompileContext
from aoa.source import Span

if TYPE_CHECKING:
    from aoa.printer import Printer

NAME = "resolve_chains"


def _fused_flag(statement: Statement) -> str | None:
    return next((a.key for a in statement.attributes if a.key in FLAG_ATTRIBUTES), None)


@dataclass(frozen=True)
class End:
    """Where a walk through the data flow stopped: a key of the source or destination, or
    a fused statement (``fused``), which lays the tensor out itself: the one that wrote it
    (walking back; ``node`` is what it wrote) or one that reads it (walking on)."""

    key: str | None
    #: the statements walked through, in execution order (a fused end's own included)
    path: tuple[Statement, ...]
    fused: Statement | None = None
    node: int | None = None

    @property
    def what(self) -> tuple[str | None, int]:
        """What tells two ends apart (the first way found to each is kept)."""
        return self.key, id(self.fused)

    def describe(self) -> str:
        if self.fused is None:
            return f"'{self.key}'"
        where = self.fused.span.location() if self.fused.span else "?"
        return f"the fused statement at {where}"


Ends = dict[tuple[str | None, int], End]


@dataclass
class DataFlow:
    """Versioned names over the statements in execution order (reverse mode: reversed and
    with sides swapped). A node is one version of a name; nodes are numbered as they are
    made, so the nodes a statement reads have lower numbers than the ones it writes."""

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
        # a node per name a statement reads first or writes: its name, the statement
        # that wrote it (None: read before any wrote it) and the ones that read it
        node_name, producer, consumers = flow.node_name, flow.producer, flow.consumers
        for executed, index in enumerate(order):
            statement = written[index]
            reads, writes = ((statement.right, statement.left) if reverse
                             else (statement.left, statement.right))
            read_nodes = []
            for name in reads:
                base = name.base
                if base == NOTHING and len(reads) == 1:
                    continue
                node = current.get(base)
                if node is None:
                    node = current[base] = len(node_name)
                    node_name.append(base)
                    producer.append(None)
                    consumers.append([executed])
                else:
                    consumers[node].append(executed)
                read_nodes.append(node)
            write_nodes = []
            for name in writes:
                base = name.base
                if base == NOTHING and len(writes) == 1:
                    continue
                node = current[base] = len(node_name)
                node_name.append(base)
                producer.append(executed)
                consumers.append([])
                write_nodes.append(node)
            flow.inputs.append(read_nodes)
            flow.outputs.append(write_nodes)
        flow.final = current
        return flow

    def executed(self, index: int) -> int:
        """The position in execution order of the statement at ``index`` in the program."""
        return len(self.statements) - 1 - index if self.reverse else index


class Chains:
    """Answers the fused macros' question: over how many shards is this name laid out?

    The layout of a fused tensor is the layout of the stored tensor its data flows from
    (a name the statement reads) or to (a name it writes). The walk goes through renames,
    casts, transposes and aliases, and through splits and concats (a piece of a split
    comes from the whole; a part of a concat goes to the joined tensor; every piece of a
    split and every part of a concat is followed), to the keys of the source or
    destination. It stops at another fused statement: a tensor that one fused statement
    writes and another reads is laid out as the writer decides (from the stored tensors it
    reaches by other ways, else as one shard), and the reader takes that layout. Ways that
    end in different shard counts are an error that names them."""

    def __init__(self, program: Program, ctx: CompileContext) -> None:
        self.program = program
        self.ctx = ctx
        self._from: dict[int, Ends] = {}
        self._to: dict[int, Ends] = {}
        self._written: dict[int, int] = {}
        #: the statement whose question is being answered (errors point at it)
        self._asked_by: Statement | None = None

    @functools.cached_property
    def flow(self) -> DataFlow:
        """The data flow, built when a fused macro or a printout first asks (most programs
        have no fused macro)."""
        return DataFlow.build(self.program, self.ctx.reverse)

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
                         _described(self._sources(node)), _described(self._destinations(node))))
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
        self._asked_by = statement
        if left != flow.reverse:
            read = next(n for n in flow.inputs[executed] if flow.node_name[n] == name)
            return self._decide(statement, name, self._sources(read), "source")
        written = next(n for n in flow.outputs[executed] if flow.node_name[n] == name)
        return self._written_count(statement, written)

    def _written_count(self, statement: Statement, node: int) -> int:
        """The layout a statement writes ``node`` in: that of the destination it reaches."""
        count = self._written.get(node)
        if count is None:
            count = 1 if self.ctx.destination is None else self._decide(
                statement, self.flow.node_name[node], self._destinations(node), "destination")
            self._written[node] = count
        return count

    def _sources(self, node: int) -> Ends:
        """The ends of the ways from ``node`` back to where its data is laid out: source
        keys, or the fused statement that wrote it."""
        flow = self.flow

        def upstream(n: int) -> list[int]:
            producer = flow.producer[n]
            if producer is None or _fused_flag(flow.statements[producer]) is not None:
                return []
            return flow.inputs[producer]

        # answered in ascending order, each node finds its inputs' answers made (no
        # recursion, however long the chain)
        for n in sorted(_unanswered(node, upstream, self._from)):
            self._from[n] = self._sources_of(n)
        return self._from[node]

    def _sources_of(self, node: int) -> Ends:
        flow = self.flow
        producer = flow.producer[node]
        if producer is None:
            end = End(flow.node_name[node], ())
            return {end.what: end}
        statement = flow.statements[producer]
        if _fused_flag(statement) is not None:
            end = End(None, (statement,), statement, node)
            return {end.what: end}
        ends: Ends = {}
        for read in flow.inputs[producer]:
            for what, end in self._from[read].items():
                if what not in ends:
                    ends[what] = End(end.key, (*end.path, statement), end.fused, end.node)
        return ends

    def _destinations(self, node: int) -> Ends:
        """The ends of the ways from ``node`` on: destination keys, and the fused
        statements that read it."""
        flow = self.flow

        def downstream(n: int) -> list[int]:
            return [written for consumer in flow.consumers[n]
                    if _fused_flag(flow.statements[consumer]) is None
                    for written in flow.outputs[consumer]]

        for n in sorted(_unanswered(node, downstream, self._to), reverse=True):
            self._to[n] = self._destinations_of(n)
        return self._to[node]

    def _destinations_of(self, node: int) -> Ends:
        flow = self.flow
        ends: Ends = {}
        name = flow.node_name[node]
        if flow.final.get(name) == node and name in self.ctx.destination_keys:
            end = End(name, ())
            ends[end.what] = end
        for consumer in flow.consumers[node]:
            statement = flow.statements[consumer]
            if _fused_flag(statement) is not None:
                end = End(None, (statement,), statement)
                ends.setdefault(end.what, end)
                continue
            for written in flow.outputs[consumer]:
                for what, end in self._to[written].items():
                    if what not in ends:
                        ends[what] = End(end.key, (statement, *end.path), end.fused)
        return ends

    def _count(self, end: End, what: str) -> int | None:
        """Over how many shards the tensor is laid out at ``end`` (None: not said there)."""
        if end.key is not None:
            info = self.ctx.source if what == "source" else self.ctx.destination
            count, per_key = shard_count(info, end.key)
            if count is None and per_key:
                raise ChainError(
                    f"the {what} shards of '{end.key}' and its optimizer states disagree: "
                    + ", ".join(f"{k}: {v}" for k, v in per_key.items()),
                    self._asked_by.span if self._asked_by else None,
                    hint="Every optimizer state must be sharded like its parameter.")
            return count
        if what == "destination" or end.fused is None or end.node is None:
            return None  # a fused statement reads it: in the layout decided here
        producer = self.flow.producer[end.node]
        if (_fused_flag(end.fused) in PER_SHARD_FLAGS and producer is not None
                and len(self.flow.outputs[producer]) == 1):
            return self._written_count(end.fused, end.node)
        return 1  # fused_qkv's grouped layout, or a plain part of a split form

    def _decide(self, statement: Statement, name: str, ends: Ends, what: str) -> int:
        counts: dict[int, End] = {}
        for end in ends.values():
            count = self._count(end, what)
            if count is not None:
                counts.setdefault(count, end)
        if len(counts) > 1:
            (a, first), (b, second) = list(counts.items())[:2]
            raise ChainError(
                f"'{name}' is laid out over {a} shards one way and {b} the other: its "
                f"{what} key is ambiguous", statement.span,
                related=[_way(name, end, n, what) for n, end in ((a, first), (b, second))],
                hint="Route the fused tensor to keys of one shard layout, or give each "
                     "layout its own fused statement and temporary name.")
        if counts:
            return next(iter(counts))
        if any(end.fused is not None for end in ends.values()):
            self.ctx.note(f"'{name}' flows into another fused statement and reaches no "
                          "destination key: laid out as one shard", statement.span)
        elif self.ctx.source if what == "source" else self.ctx.destination:
            self.ctx.note(f"no {what} shards found for '{name}': laid out as one shard",
                          statement.span)
        return 1


def _unanswered(start: int, neighbours: Callable[[int], list[int]], answered: dict) -> set[int]:
    """The nodes reachable from ``start`` that have no answer yet (an explicit stack)."""
    found: set[int] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node in found or node in answered:
            continue
        found.add(node)
        stack.extend(neighbours(node))
    return found


def _described(ends: Ends) -> list[str]:
    return [end.describe() for end in ends.values()] or ["nothing known"]


def _way(name: str, end: End, count: int, what: str) -> tuple[str, Span | None]:
    """A note on one way of an ambiguous layout: where it ends and through what."""
    if end.fused is not None:
        return (f"'{name}' is written by `{end.fused}`, which lays it out over {count} "
                "shards", end.fused.span)
    if not end.path:
        return f"'{name}' is the {what} key '{end.key}' itself ({count} shards)", None
    shown = [f"`{statement}`" for statement in end.path]
    if len(shown) > 4:
        shown = [*shown[:2], f"... ({len(shown) - 3} more)", shown[-1]]
    nearest = end.path[-1] if what == "destination" else end.path[0]
    reach = "reaches" if what == "destination" else "comes from"
    return (f"'{name}' {reach} '{end.key}' ({count} shards) through {', '.join(shown)}",
            nearest.span)


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
    return ChainedProgram(program, Chains(program, ctx))
