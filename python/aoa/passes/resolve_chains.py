"""Resolve chains: the data flow of every name, so a temporary can be traced back to the
source key it comes from and on to the destination key it reaches (spec 5.11).

The fused macros ask their shard counts through it: `w -> tmp, fused_ffn` then
`tmp^T -> dst` lays `tmp` out for the shards of `dst`. Unlike Paddle's last-record-wins
maps, the whole graph is followed (spec 0.4): every name is versioned at each write, so a
rebinding such as `t -> t, dtype=...` is an edge, not a loop, and a temporary read twice,
split or concatenated is followed every way (the ways must agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aoa.errors import ChainError
from aoa.ir import FLAG_ATTRIBUTES, NOTHING, Program, Statement
from aoa.layout import shard_count
from aoa.passes.context import CompileContext
from aoa.source import Span

#: The fused macros that lay their fused tensor out shard by shard.
PER_SHARD_FLAGS = frozenset({"fused_ffn", "fused_qkv_old"})


def _fused_flag(statement: Statement) -> str | None:
    return next((a.key for a in statement.attributes if a.key in FLAG_ATTRIBUTES), None)


@dataclass(frozen=True)
class End:
    """Where a walk through the data flow stopped, and over how many shards the tensor is
    laid out there: a key of the source or destination, or (``key`` None) the fused
    statement that made the tensor."""

    count: int
    key: str | None
    #: the statements walked through, in execution order
    path: tuple[Statement, ...]


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
    #: written statement -> its position in execution order
    position: dict[int, int] = field(default_factory=dict)

    @classmethod
    def build(cls, program: Program, reverse: bool) -> DataFlow:
        written = list(program.statements)
        order = list(reversed(range(len(written)))) if reverse else list(range(len(written)))
        flow = cls([written[i] for i in order], reverse)
        current: dict[str, int] = {}
        for executed, index in enumerate(order):
            flow.position[id(written[index])] = executed
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

    def _new_node(self, name: str, producer: int | None) -> int:
        self.node_name.append(name)
        self.producer.append(producer)
        self.consumers.append([])
        return len(self.node_name) - 1


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

    def __init__(self, flow: DataFlow, ctx: CompileContext) -> None:
        self.flow = flow
        self.ctx = ctx
        self._from: dict[int, dict[int, End]] = {}
        self._to: dict[int, dict[int, End]] = {}
        self._written: dict[int, int] = {}
        #: nodes whose data reaches another fused statement (which takes their layout)
        self._into_fused: set[int] = set()
        #: the statement whose question is being answered (errors point at it)
        self._asked_by: Statement | None = None

    def shard_count(self, statement: Statement, name: str, *, left: bool) -> int:
        """Shards of ``name``, written on the ``left`` (or right) of ``statement``.

        A name the statement reads is counted where its data comes from (the source
        checkpoint), one it writes where its data goes (the destination); in reverse mode
        the right side is read and the left written."""
        flow = self.flow
        executed = flow.position[id(statement)]
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
                statement, self.flow.node_name[node], self._destinations(node), "destination",
                into_fused=node)
            self._written[node] = count
        return count

    def _sources(self, node: int) -> dict[int, End]:
        """Shard count -> the first way found from ``node`` back to where its data is laid
        out: a source key, or the fused statement that wrote it."""
        flow = self.flow

        def upstream(n: int) -> list[int]:
            producer = flow.producer[n]
            if producer is None or _fused_flag(flow.statements[producer]) is not None:
                return []
            return flow.inputs[producer]

        # the nodes a statement reads were made before the nodes it writes: answered in
        # ascending order, each finds its inputs' answers made (no recursion, however long
        # the chain)
        for n in sorted(_reachable(node, upstream, self._from)):
            self._from[n] = self._sources_of(n)
        return self._from[node]

    def _sources_of(self, node: int) -> dict[int, End]:
        flow, ends = self.flow, {}
        producer = flow.producer[node]
        if producer is None:
            key = flow.node_name[node]
            count = self._stored_count(self.ctx.source, key, "source")
            if count is not None:
                ends[count] = End(count, key, ())
            return ends
        statement = flow.statements[producer]
        flag = _fused_flag(statement)
        if flag is not None:
            # fused_qkv's grouped layout and a split form's plain parts: one shard
            count = (self._written_count(statement, node) if flag in PER_SHARD_FLAGS
                     and len(flow.outputs[producer]) == 1 else 1)
            ends[count] = End(count, None, (statement,))
            return ends
        for read in flow.inputs[producer]:
            for count, end in self._from[read].items():
                ends.setdefault(count, End(count, end.key, (*end.path, statement)))
        return ends

    def _destinations(self, node: int) -> dict[int, End]:
        """Shard count -> the first way found from ``node`` on to a destination key."""
        flow = self.flow

        def downstream(n: int) -> list[int]:
            return [written for consumer in flow.consumers[n]
                    if _fused_flag(flow.statements[consumer]) is None
                    for written in flow.outputs[consumer]]

        for n in sorted(_reachable(node, downstream, self._to), reverse=True):
            self._to[n] = self._destinations_of(n)
        return self._to[node]

    def _destinations_of(self, node: int) -> dict[int, End]:
        flow, ends = self.flow, {}
        name = flow.node_name[node]
        if flow.final.get(name) == node and name in self.ctx.destination_keys:
            count = self._stored_count(self.ctx.destination, name, "destination")
            if count is not None:
                ends[count] = End(count, name, ())
        for consumer in flow.consumers[node]:
            statement = flow.statements[consumer]
            if _fused_flag(statement) is not None:
                self._into_fused.add(node)  # it reads the tensor in the layout decided here
                continue
            for written in flow.outputs[consumer]:
                for count, end in self._to[written].items():
                    ends.setdefault(count, End(count, end.key, (statement, *end.path)))
                if written in self._into_fused:
                    self._into_fused.add(node)
        return ends

    def _stored_count(self, info: dict | None, key: str, what: str) -> int | None:
        count, per_key = shard_count(info, key)
        if count is None and per_key:
            raise ChainError(
                f"the {what} shards of '{key}' and its optimizer states disagree: "
                + ", ".join(f"{k}: {v}" for k, v in per_key.items()),
                self._asked_by.span if self._asked_by else None,
                hint="Every optimizer state must be sharded like its parameter.")
        return count

    def _decide(self, statement: Statement, name: str, ends: dict[int, End], what: str,
                into_fused: int | None = None) -> int:
        if len(ends) > 1:
            first, second = list(ends.values())[:2]
            raise ChainError(
                f"'{name}' is laid out over {first.count} shards one way and {second.count} "
                f"the other: its {what} key is ambiguous", statement.span,
                related=[_describe(name, end, what) for end in (first, second)],
                hint="Route the fused tensor to keys of one shard layout, or give each "
                     "layout its own fused statement and temporary name.")
        if ends:
            return next(iter(ends))
        if into_fused in self._into_fused:
            self.ctx.note(f"'{name}' flows into another fused statement and reaches no "
                          "destination key: laid out as one shard", statement.span)
        elif self.ctx.source if what == "source" else self.ctx.destination:
            self.ctx.note(f"no {what} shards found for '{name}': laid out as one shard",
                          statement.span)
        return 1


def _reachable(start: int, neighbours, answered: dict) -> set[int]:
    """The nodes from ``start`` on that are not answered yet (an explicit stack)."""
    found: set[int] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node in found or node in answered:
            continue
        found.add(node)
        stack.extend(neighbours(node))
    return found


def _describe(name: str, end: End, what: str) -> tuple[str, Span | None]:
    """A note on one way of an ambiguous layout: where it ends and through what."""
    shown = [f"`{statement}`" for statement in end.path]
    if len(shown) > 4:
        shown = [*shown[:2], f"... ({len(shown) - 3} more)", shown[-1]]
    through = ", ".join(shown)
    if end.key is None:
        return (f"'{name}' is written by `{end.path[0]}`, which lays it out over "
                f"{end.count} shards", end.path[0].span)
    if not end.path:
        return f"'{name}' is the {what} key '{end.key}' itself ({end.count} shards)", None
    nearest = end.path[-1] if what == "destination" else end.path[0]
    reach = "reaches" if what == "destination" else "comes from"
    return (f"'{name}' {reach} '{end.key}' ({end.count} shards) through {through}",
            nearest.span)


def run(program: Program, ctx: CompileContext) -> Program:
    ctx.facts["chains"] = Chains(DataFlow.build(program, ctx.reverse), ctx)
    return program
