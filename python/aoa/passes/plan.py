"""Plan: for each destination shard, the copies that fill it, read from the physical source
shards; validated before any byte moves (spec 6.7, 0.3).

`Planner.answer` is Paddle's `find_shard_sources` without its state changes: the pieces of
the destination key's tensor that intersect the asked box. `Planner.plan` turns the answers
for every destination shard into a Plan and refuses what would produce wrong data.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import NamedTuple

from aoa.dtypes import CAST_TARGETS, is_exact_widening
from aoa.errors import PlanError, ValidationError
from aoa.layout import BETA_POW_SUFFIXES, ShardDesc, split_optimizer_suffix
from aoa.passes.context import CompileContext
from aoa.passes.propagate_shapes import Op, Permute, SymbolicState, Tensor
from aoa.plan import Plan, PlannedCopy

Box = tuple[int, ...]


class Entry(NamedTuple):
    """``destination[target box] = ops(source[source_key][source box])``, global boxes."""

    target_lo: Box
    target_hi: Box
    source_key: str
    source_lo: Box
    source_hi: Box
    ops: tuple[Op, ...]
    order: tuple[int, ...] | None

    def postprocess(self) -> list[str] | None:
        """Paddle's postprocess list: permutation strings and dtype names, in order."""
        if not self.ops:
            return None
        return [op.text if isinstance(op, Permute) else op for op in self.ops]


def _describe(shard: ShardDesc) -> str:
    region = ", ".join(f"{o}:{o + n}" for o, n in zip(shard.global_offset, shard.local_shape))
    return f"'{shard.key}' [{region}]"


def result_dtype(ops: Sequence[Op], source_dtype: str | None) -> str | None:
    """The dtype a piece has after its casts."""
    for op in reversed(ops):
        if isinstance(op, str):
            return op
    return source_dtype


class Planner:
    def __init__(self, ctx: CompileContext) -> None:
        self.ctx = ctx
        self.state: SymbolicState = ctx.facts["symbolic"]
        self._source_shards: dict[str, list[ShardDesc]] = {}

    # -- answers -------------------------------------------------------------------------
    def tensor_for(self, key: str) -> Tensor | None:
        model_key = split_optimizer_suffix(key)[0]
        if model_key not in self.state.outputs:
            raise ValidationError(
                f"'{model_key}' is not a destination of this program",
                hint="With a destination given, every destination key is an output; without "
                     "one, only tensors that no statement consumes are.")
        return self.state.outputs[model_key]

    def answer(self, target: ShardDesc) -> list[Entry] | None:
        """The pieces that fill ``target``; None for a destination declared with `_ -> X`."""
        tensor = self.tensor_for(target.key)
        if tensor is None:
            return None
        _, suffix = split_optimizer_suffix(target.key)
        if suffix in BETA_POW_SUFFIXES:
            return self._beta_pow(target, tensor, suffix)
        lo = target.global_offset
        hi = tuple(o + n for o, n in zip(lo, target.local_shape))
        if len(lo) != len(tensor.shape):
            raise ValidationError(
                f"destination {_describe(target)} has {len(lo)} dimensions, but the program "
                f"makes it with {len(tensor.shape)} (shape {list(tensor.shape)})")
        removed = self.state.removed
        entries = []
        for piece in tensor.pieces:
            if piece.key in removed:
                continue
            i_lo = tuple(map(max, lo, piece.target_lo))
            i_hi = tuple(map(min, hi, piece.target_hi))
            if any(a >= b for a, b in zip(i_lo, i_hi)):
                continue
            order = piece.order
            if order is None:
                s_lo = tuple(s + a - t for s, a, t in zip(piece.source_lo, i_lo, piece.target_lo))
                s_hi = tuple(s + b - a for s, a, b in zip(s_lo, i_lo, i_hi))
            else:
                s_lo_list, s_hi_list = list(piece.source_lo), list(piece.source_hi)
                for i, axis in enumerate(order):
                    s_lo_list[axis] = piece.source_lo[axis] + i_lo[i] - piece.target_lo[i]
                    s_hi_list[axis] = s_lo_list[axis] + i_hi[i] - i_lo[i]
                s_lo, s_hi = tuple(s_lo_list), tuple(s_hi_list)
            entries.append(Entry(i_lo, i_hi, piece.key + (suffix or ""), s_lo, s_hi, piece.ops,
                                 order))
        return entries

    def _beta_pow(self, target: ShardDesc, tensor: Tensor, suffix: str) -> list[Entry]:
        keys = list(dict.fromkeys(p.key for p in tensor.pieces if p.key not in self.state.removed))
        if not keys:
            return []
        if len(keys) > 1:
            self.ctx.note(f"'{target.key}' comes from several parameters ({', '.join(keys)}); "
                          f"its accumulator is copied from '{keys[0]}'")
        lo = target.global_offset
        hi = tuple(o + n for o, n in zip(lo, target.local_shape))
        return [Entry(lo, hi, keys[0] + suffix, lo, hi, (), None)]

    # -- validation ----------------------------------------------------------------------
    def check(self, target: ShardDesc, tensor: Tensor, entries: list[Entry]) -> None:
        """Refuse what would leave wrong bytes in ``target`` (spec 0.3)."""
        _, suffix = split_optimizer_suffix(target.key)
        writer = self.state.writers.get(split_optimizer_suffix(target.key)[0])
        span = writer.span if writer is not None else None
        if suffix not in BETA_POW_SUFFIXES and tuple(target.global_shape) != tensor.shape:
            raise ValidationError(
                f"destination '{target.key}' is declared with global shape "
                f"{list(target.global_shape)}, but the program produces {list(tensor.shape)}",
                span, hint="Declare the destination with the shape the statements make, or "
                           "change the statements (a missing ^T or permute?).")
        for entry in entries:
            shards = self.ctx.source.get(entry.source_key)
            if not shards:
                raise ValidationError(
                    f"destination {_describe(target)} needs '{entry.source_key}', which the "
                    "source does not have", span,
                    hint="Optimizer states follow their parameter only where the source has "
                         "them; give the destination no such key, or add it to the source.")
            produced = result_dtype(entry.ops, shards[0].dtype)
            if target.dtype is not None and produced is not None and produced != target.dtype:
                how = ("is cast to" if any(isinstance(op, str) for op in entry.ops)
                       else "is")
                raise ValidationError(
                    f"destination {_describe(target)} is {target.dtype}, but "
                    f"'{entry.source_key}' {how} {produced}", span,
                    hint=f"Cast to the destination's dtype: `... -> {target.key}, "
                         f"dtype='{target.dtype}'` (or declare the destination {produced}).")
        self._check_coverage(target, entries)

    def _check_coverage(self, target: ShardDesc, entries: list[Entry]) -> None:
        wanted = prod(target.local_shape)
        covered = sum(prod(b - a for a, b in zip(e.target_lo, e.target_hi)) for e in entries)
        boxes = sorted(entries, key=lambda e: e.target_lo)
        for i, first in enumerate(boxes):
            for second in boxes[i + 1:]:
                if second.target_lo[0] >= first.target_hi[0]:
                    break
                if all(max(a, c) < min(b, d) for a, b, c, d in zip(
                        first.target_lo, first.target_hi, second.target_lo, second.target_hi)):
                    raise ValidationError(
                        f"destination {_describe(target)} would be written twice: by "
                        f"'{first.source_key}' and by '{second.source_key}'")
        if covered != wanted:
            deleted = [(k, s) for k, s in self.state.removed.items()
                       if any(p.key == k for p in self.state.outputs[
                           split_optimizer_suffix(target.key)[0]].pieces)]
            related = [(f"'{k}' is deleted here", s.span) for k, s in deleted]
            raise ValidationError(
                f"{wanted - covered} of the {wanted} elements of destination "
                f"{_describe(target)} are written by no statement", related=related,
                hint=f"Map a source to them, or declare the destination empty with "
                     f"`_ -> {split_optimizer_suffix(target.key)[0]}` to leave it as it is.")

    # -- physical sources ----------------------------------------------------------------
    def source_shards(self, key: str) -> list[ShardDesc]:
        """The distinct shards of a source key (replicas once), checked to tile it."""
        shards = self._source_shards.get(key)
        if shards is not None:
            return shards
        distinct = list({s.global_offset: s for s in reversed(self.ctx.source[key])}.values())
        distinct.reverse()
        shape = distinct[0].global_shape
        if sum(s.numel for s in distinct) != prod(shape) or any(
                s.global_shape != shape for s in distinct):
            raise PlanError(f"the shards of source key '{key}' do not tile its global shape "
                            f"{list(shape)} exactly once",
                            hint="List every shard of the tensor once, with its global offset.")
        self._source_shards[key] = distinct
        return distinct

    def lower_casts(self, ops: Sequence[Op], source_dtype: str | None,
                    destination_dtype: str | None) -> tuple[str, ...]:
        """The rounding steps between the source and the destination dtype: casts that
        cannot change a value (an exact widening) are dropped."""
        current = source_dtype or "float32"
        steps: list[str] = []
        for op in ops:
            if isinstance(op, str) and not is_exact_widening(current, op):
                steps.append(op)
                current = op
        if steps and steps[-1] == (destination_dtype or "float32"):
            steps.pop()
        return tuple(steps)

    # -- the plan ------------------------------------------------------------------------
    def targets(self) -> list[ShardDesc]:
        if self.ctx.destination is not None:
            return [shard for shards in self.ctx.destination.values() for shard in shards]
        return [ShardDesc.full(name, tensor.shape, self.real_dtype(name, tensor))
                for name, tensor in sorted(self.state.outputs.items()) if tensor is not None]

    def real_dtype(self, name: str, tensor: Tensor) -> str | None:
        """Without a destination, an output's dtype is the one its casts produce (spec 7.2)."""
        last = set()
        for piece in tensor.pieces:
            casts = [op for op in piece.ops if isinstance(op, str) and op in CAST_TARGETS]
            if casts:
                last.add(casts[-1])
        if len(last) > 1:
            raise ValidationError(f"the pieces of output '{name}' are cast to different dtypes "
                                  f"({', '.join(sorted(last))})",
                                  hint="Cast the whole tensor after assembling it.")
        return last.pop() if last else tensor.dtype

    def plan(self, targets: Sequence[ShardDesc] | None = None) -> Plan:
        """Copies for every destination shard (or for ``targets``: any boxes of outputs)."""
        destinations = self.targets() if targets is None else list(targets)
        sources: list[ShardDesc] = []
        source_index: dict[tuple[str, Box], int] = {}
        copies: list[PlannedCopy] = []
        untouched: list[int] = []
        for index, target in enumerate(destinations):
            entries = self.answer(target)
            if entries is None:
                untouched.append(index)
                continue
            self.check(target, self.tensor_for(target.key), entries)
            for entry in entries:
                for shard in self.source_shards(entry.source_key):
                    lo = tuple(map(max, entry.source_lo, shard.global_offset))
                    hi = tuple(min(a, o + n) for a, o, n in
                               zip(entry.source_hi, shard.global_offset, shard.local_shape))
                    if any(a >= b for a, b in zip(lo, hi)):
                        continue
                    where = (shard.key, shard.global_offset)
                    s = source_index.get(where)
                    if s is None:
                        s = source_index[where] = len(sources)
                        sources.append(shard)
                    order = entry.order
                    delta = [a - b for a, b in zip(lo, entry.source_lo)]
                    size = [b - a for a, b in zip(lo, hi)]
                    if order is not None:
                        delta = [delta[a] for a in order]
                        size = [size[a] for a in order]
                    copies.append(PlannedCopy(
                        index,
                        tuple(t + d - o for t, d, o in
                              zip(entry.target_lo, delta, target.global_offset)),
                        tuple(size), s,
                        tuple(a - o for a, o in zip(lo, shard.global_offset)),
                        order, self.lower_casts(entry.ops, shard.dtype, target.dtype)))
        if targets is None:
            self._note_unused_sources({shard.key for shard in sources})
        notes = [note.render() for note in self.ctx.notes]
        return Plan(sources, destinations, copies, notes, untouched)

    def _note_unused_sources(self, used: set[str]) -> None:
        unused = sorted(set(self.ctx.source) - used)
        if unused:
            shown = ", ".join(f"'{k}'" for k in unused[:5])
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            self.ctx.note(f"{len(unused)} source keys are used by nothing: {shown}{more}")
