"""Share instances: a template's instances that are independent and laid out alike are
compiled once.

`model.layers.$LAYER_ID.mlp.experts.$EXPERT_ID.w^T -> ...` becomes thousands of statements
that differ only in their names. When an instance reads only source keys nobody else writes,
writes only keys nobody else reads or writes, and its keys have the same shard layouts and
dtypes as an instance already kept, the later passes would repeat the kept one's work name
for name. Such an instance is set aside here; shape propagation gives its destination keys
the kept instance's tensors with the source keys renamed, and planning (memoized per layout
and source layout) does the rest. The result is the same as expanding every instance.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from aoa.ir import NOTHING, Program, Statement
from aoa.layout import (
    OPTIMIZER_SUFFIXES,
    SHARD_COUNT_SUFFIXES,
    ShardDesc,
    split_optimizer_suffix,
)
from aoa.passes.context import CompileContext


class SharedInstance(NamedTuple):
    """``statement`` is compiled as ``kept``: kept names map position by position to its own
    (a NamedTuple: a big model has tens of thousands)."""

    statement: Statement
    kept: Statement


def _signatures(info: dict[str, list[ShardDesc]] | None, layouts: dict[str, int]) -> dict:
    """Per key, what stands for the layouts of it and its optimizer states: its layout id,
    paired with its states' ids where the checkpoint holds states of it."""
    states: dict[str, list[tuple[str, int]]] = {}
    for key in info or ():
        if key.endswith(OPTIMIZER_SUFFIXES):
            model_key, suffix = split_optimizer_suffix(key)
            if suffix in SHARD_COUNT_SUFFIXES:
                states.setdefault(model_key, []).append((suffix, layouts[key]))
    if not states:
        return layouts
    signatures: dict[str, object] = dict(layouts)
    for model_key, found in states.items():
        signatures[model_key] = (layouts.get(model_key), tuple(sorted(found)))
    return signatures


def run(program: Program, ctx: CompileContext) -> Program:
    ctx.facts["shared"] = []
    if ctx.destination is None or ctx.reverse:
        return program
    statements = program.statements
    # each statement's read keys (names without ^T), worked out once: big models have
    # tens of thousands of instances and every step below needs them
    bases = [tuple([n.base for n in s.left]) for s in statements]
    reads = Counter([b for names in bases for b in names])
    writes = Counter([n.base for s in statements for n in s.right])
    source_signature = _signatures(ctx.source, ctx.source_layouts).get
    destination_signature = _signatures(ctx.destination, ctx.destination_layouts).get
    source_keys = ctx.source_keys
    kept_by_signature: dict[tuple, Statement] = {}
    kept: list[Statement] = []
    shared: list[SharedInstance] = ctx.facts["shared"]
    for s, own_reads in zip(statements, bases):
        if s.origin is None or not _independent(s, own_reads, reads, writes, source_keys):
            kept.append(s)
            continue
        # Instances of one template share their attribute tuple object (and the written
        # statement it came from); equal names of sources and destinations complete it,
        # and so does which reads name the same key (renaming maps key to key).
        signature = (id(s.attributes), id(s.written()), len(s.left), len(s.right),
                     tuple([len(n.text) != len(b) for n, b in zip(s.left, own_reads)]),
                     len(own_reads) < 2 or tuple([own_reads.index(b) for b in own_reads]),
                     tuple([source_signature(b) for b in own_reads]),
                     tuple([destination_signature(n.text) for n in s.right]))
        first = kept_by_signature.get(signature)
        if first is None:
            kept_by_signature[signature] = s
            kept.append(s)
            continue
        shared.append(SharedInstance(s, first))
    if not shared:
        return program
    return Program(tuple(kept))


def _independent(s: Statement, own_reads: tuple[str, ...], reads: Counter, writes: Counter,
                 source_keys) -> bool:
    """Reads only source keys nobody else writes; writes keys nobody else reads or writes."""
    own_writes = {n.text for n in s.right}
    if NOTHING in own_reads or NOTHING in own_writes or len(own_writes) != len(s.right):
        return False
    for name in own_reads:
        if name not in source_keys or writes[name] != (name in own_writes):
            return False
    for name in own_writes:
        if writes[name] != 1 or reads[name] != (name in own_reads) or name.endswith("^T"):
            return False
    return True
