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

import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from aoa.ir import NOTHING, Follower, Program, SharedInstances, Statement
from aoa.layout import (
    OPTIMIZER_SUFFIXES,
    SHARD_COUNT_SUFFIXES,
    ShardDesc,
    split_optimizer_suffix,
)
from aoa.passes.context import CompileContext

NAME = "share_instances"


def _signatures(info: dict[str, list[ShardDesc]] | None, shardings: dict[str, int],
                model_keys: frozenset[str]) -> dict:
    """Per key, what stands for the shardings of it and its optimizer states: its sharding
    number, paired with its states' numbers where the checkpoint holds states of it.
    ``model_keys``: the keys of ``info`` without their optimizer suffixes, which are its
    keys exactly where none has such a suffix (a suffix only shortens a key)."""
    if info is None or model_keys == info.keys():
        return shardings
    states: dict[str, list[tuple[str, int]]] = {}
    for key in info or ():
        if key.endswith(OPTIMIZER_SUFFIXES):
            model_key, suffix = split_optimizer_suffix(key)
            if suffix in SHARD_COUNT_SUFFIXES:
                states.setdefault(model_key, []).append((suffix, shardings[key]))
    if not states:
        return shardings
    signatures: dict[str, object] = dict(shardings)
    for model_key, found in states.items():
        signatures[model_key] = (shardings.get(model_key), tuple(sorted(found)))
    return signatures


def run(program: Program, ctx: CompileContext) -> Program:
    """The program with the instances that follow a kept one moved to ``Program.shared``."""
    statements = program.statements
    if ctx.destination is None or ctx.reverse or all(s.origin is None for s in statements):
        return program  # (no statement is a template's instance: nothing to share)
    # each statement's read keys (names without ^T) and written names, worked out once:
    # big models have tens of thousands of instances and every step below needs them
    bases = [(s.left[0].base,) if len(s.left) == 1 else tuple([n.base for n in s.left])
             for s in statements]
    texts = [(s.right[0].text,) if len(s.right) == 1 else tuple([n.text for n in s.right])
             for s in statements]
    reads = Counter([b for names in bases for b in names])
    writes = Counter([t[:-2] if t.endswith("^T") else t for names in texts for t in names])
    sharing = _Sharing(ctx, reads, writes)
    for start, stop in _runs_of_one_origin(statements):
        sharing.take(statements[start:stop], bases[start:stop], texts[start:stop])
    shared = tuple(SharedInstances(sharing.kept[position], tuple(followers))
                   for position, followers in sharing.followers.items())
    if not shared:
        return program
    return Program(tuple(sharing.kept), program.shared + shared)


def pays(program: Program) -> bool:
    """Whether sharing can save more than it costs ``program``: some template has three
    or more instances, or instances that are more than a rename (several names a side,
    attributes: fused macros, casts). A kept rename's follower costs the later passes
    about what compiling the rename does, so for a program of two-instance renames (a
    small model's checkpoint, compiled by the Paddle drop-in at every load) the pass's
    walk over every statement would be paid for nothing."""
    statements = program.statements
    for start, stop in _runs_of_one_origin(statements):
        first = statements[start]
        if first.origin is not None and (stop - start > 2 or (
                stop - start == 2 and (len(first.left) != 1 or len(first.right) != 1
                                       or first.attributes))):
            return True
    return False


def run_where_it_pays(program: Program, ctx: CompileContext) -> Program:
    """`run` where it `pays`, else the program as it is: the same tensors and plan either
    way (sharing changes what the later passes see, never what they make)."""
    return run(program, ctx) if pays(program) else program


def _runs_of_one_origin(statements: Sequence[Statement]) -> Iterator[tuple[int, int]]:
    """(start, stop) of each run of statements made by one expansion (one Origin object:
    a template's instances); a statement the user wrote is a run of its own. One at a
    time: `pays` stops at the first run that pays, in a big model's first statements."""
    start = 0
    for index in range(1, len(statements) + 1):
        if (index == len(statements) or statements[index].origin is None
                or statements[index].origin is not statements[start].origin):
            yield start, index
            start = index


class _Sharing:
    """Which instances are kept and which follow a kept one, a template's instances at a
    time: the tests that settle most of them run over all of a template's names at once."""

    def __init__(self, ctx: CompileContext, reads: Counter, writes: Counter) -> None:
        self.reads, self.writes = reads, writes
        self.source_keys = ctx.source_keys
        self.source_signature = _signatures(ctx.source, ctx.source_shardings,
                                            ctx.source_keys).get
        self.destination_signature = _signatures(ctx.destination, ctx.destination_shardings,
                                                 ctx.destination_keys).get
        self.written_once = {name for name, count in writes.items()
                             if count == 1 and not name.endswith("^T")}
        self.read_once = {name for name, count in reads.items() if count == 1}
        #: what instances have alike -> the signature of their keys -> the kept one's
        #: position in ``kept``
        self.kept_by_signature: dict[tuple, dict[tuple, int]] = {}
        self.kept: list[Statement] = []
        #: position of a kept statement in ``kept`` -> the instances that follow it
        self.followers: dict[int, list[Follower]] = {}

    def take(self, run: Sequence[Statement], bases: Sequence[tuple[str, ...]],
             texts: Sequence[tuple[str, ...]]) -> None:
        if run[0].origin is None:
            self.kept.extend(run)
            return
        if self._all_independent(bases, texts):
            self._share(run, bases, texts)
            return
        independent = [_independent(s, b, self.reads, self.writes, self.source_keys)
                       for s, b in zip(run, bases)]
        for is_independent, group in itertools.groupby(range(len(run)),
                                                       independent.__getitem__):
            positions = list(group)
            start, stop = positions[0], positions[-1] + 1
            if is_independent:
                self._share(run[start:stop], bases[start:stop], texts[start:stop])
            else:
                self.kept.extend(run[start:stop])

    def _all_independent(self, bases, texts) -> bool:
        """Every instance reads source keys and writes keys written once; nobody writes
        what it reads nor reads what it writes, or it writes in place (`k^T -> k`) the very
        keys it reads, which nobody else reads (enough for `_independent` of each, and
        usual)."""
        read = [b for names in bases for b in names]
        written = [t for names in texts for t in names]
        if not (self.source_keys.issuperset(read) and self.written_once.issuperset(written)
                and NOTHING not in read and NOTHING not in written):
            return False
        if self.writes.keys().isdisjoint(read) and self.reads.keys().isdisjoint(written):
            return True
        return list(bases) == list(texts) and self.read_once.issuperset(read)

    def _share(self, run: Sequence[Statement], bases, texts) -> None:
        """Independent instances of one expansion: each is kept, or follows the first kept
        one whose keys are laid out alike."""
        first = run[0]
        # Instances of one expansion share their attributes and the written statement they
        # came from, and so their counts of names and where ^T is. The written statement
        # is told by identity, not hashed name by name: two equal ones write the same keys,
        # so their instances are never independent, and sharing never meets both
        alike = (first.attributes, id(first.written()), len(first.left), len(first.right),
                 tuple([len(n.text) != len(b) for n, b in zip(first.left, bases[0])]))
        signatures: Iterable[tuple]
        if len(bases[0]) == 1 and len(texts[0]) == 1:  # the usual: a rename's instances
            source_signature, destination_signature = (self.source_signature,
                                                       self.destination_signature)
            signatures = [(source_signature(read), destination_signature(written))
                          for (read,), (written,) in zip(bases, texts)]
        else:
            columns = [list(map(self.source_signature, names)) for names in zip(*bases)]
            columns += [list(map(self.destination_signature, names)) for names in zip(*texts)]
            if len(bases[0]) > 1:  # which reads name the same key (renaming maps key to key)
                columns.append([tuple([names.index(b) for b in names]) for names in bases])
            if not columns:  # no names to rename: nothing to share
                self.kept.extend(run)
                return
            signatures = zip(*columns)
        kept_by_signature = self.kept_by_signature.setdefault(alike, {})
        for s, reads, signature in zip(run, bases, signatures):
            kept = kept_by_signature.get(signature)
            if kept is None:
                kept_by_signature[signature] = len(self.kept)
                self.kept.append(s)
            elif kept in self.followers:
                self.followers[kept].append(Follower(s, reads))
            else:
                self.followers[kept] = [Follower(s, reads)]


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
