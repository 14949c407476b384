"""Plan: for each destination shard, the copies that fill it, read from the physical source
shards; validated before any byte moves (spec 6.7, 0.3).

The pass plans every destination shard (the declared ones, or without a destination the
outputs the program makes, whole). `Planner.answer` is Paddle's `find_shard_sources`
without its state changes: the pieces of the destination key's tensor that intersect the
asked box. `Planner.plan` turns the answers for shards into a Plan and refuses what would
produce wrong data.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from operator import add, attrgetter, sub
from typing import TYPE_CHECKING, NamedTuple

from aoa import symbolic
from aoa.dtypes import CAST_TARGETS, is_exact_widening
from aoa.errors import ValidationError
from aoa.ir import Statement
from aoa.layout import BETA_POW_SUFFIXES, ShardDesc, distinct_boxes, split_optimizer_suffix
from aoa.passes.context import CompileContext
from aoa.plan import CopyTable, KeyedCopy, Plan
from aoa.printer import shard_region
from aoa.symbolic import Box, Entry, Op, SymbolicTensors, Tensor, dtype_after

if TYPE_CHECKING:
    from aoa.printer import Printer

NAME = "plan"

#: the pieces that fill a destination shard, each with the source key it reads
Answer = list[tuple[str, Entry]]


class _SourceShard(NamedTuple):
    """A source shard named by the tensor's slot (which source key) and the position of the
    shard among that key's distinct shards."""

    slot: int
    shard: int


class _ShardCopy(NamedTuple):
    """One copy of a destination shard, reading ``source``."""

    source: _SourceShard
    destination_start: Box
    shape: Box
    source_start: Box
    order: tuple[int, ...] | None
    casts: tuple[str, ...]


#: what planning one key's shards leaves: the reads, as (slot, positions of its shards), and
#: the copies
_KeyPlan = tuple[list[tuple[int, tuple[int, ...]]], list[KeyedCopy]]


class _ShardRead(NamedTuple):
    """One read of an entry from one source shard, relative to the entry's boxes."""

    shard: int  # position among the key's distinct shards
    target_delta: Box
    shape: Box
    source_start: Box  # local to the shard


def _distinct_positions(shards: Sequence[ShardDesc]) -> list[int] | None:
    """Which listed shards are distinct (replicas once; None: all). The context checked,
    as the shards came in, that these tile the global shape exactly."""
    positions = distinct_boxes(shards)
    return None if len(positions) == len(shards) else positions


def _side_by_side(boxes: Sequence[tuple[Box, Box, str]]) -> bool:
    """Whether ``boxes`` (lo, hi, source key) are alike on every axis but one, along which
    none overlaps the next: then no two share an element, which is told without comparing
    every pair (the pieces of a fused tensor lie so); False does not say they overlap."""
    first_lo, first_hi, _ = boxes[0]
    for axis in range(len(first_lo)):
        lo_rest = first_lo[:axis] + first_lo[axis + 1:]
        hi_rest = first_hi[:axis] + first_hi[axis + 1:]
        if all(lo[:axis] + lo[axis + 1:] == lo_rest and hi[:axis] + hi[axis + 1:] == hi_rest
               for lo, hi, _ in boxes):
            extents = sorted([(lo[axis], hi[axis]) for lo, hi, _ in boxes])
            return all(end <= start for (_, end), (start, _) in itertools.pairwise(extents))
    return False


def _describe(shard: ShardDesc) -> str:
    return f"'{shard.key}' [{shard_region(shard)}]"


def _how(ops) -> str:
    """How a source key comes to its dtype, for a message: cast, or as it is."""
    return "is cast to" if any(isinstance(op, str) for op in ops) else "is"


class _SourceIndex:
    """The source shards a plan reads, each listed once, in the order first read.

    Most source keys are read by one destination key only: their shards are appended in
    one step, remembered in ``_first`` as (first index, positions); a key read again gets a
    position -> index map in ``_index``."""

    def __init__(self, distinct_shards) -> None:
        self.shards: list[ShardDesc] = []
        self._distinct_shards = distinct_shards
        self._first: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._index: dict[str, dict[int, int]] = {}

    def ids(self, key: str, positions: tuple[int, ...]) -> Sequence[int]:
        """Plan indices of the shards of ``key`` at ``positions`` among its distinct ones."""
        known = self._index.get(key)
        if known is None:
            listed = self._first.get(key)
            if listed is None:
                first = len(self.shards)
                self.shards += map(self._distinct_shards(key).__getitem__, positions)
                self._first[key] = (first, positions)
                return range(first, first + len(positions))
            first, read = listed
            known = self._index[key] = {p: first + i for i, p in enumerate(read)}
        ids = []
        for position in positions:
            index = known.get(position)
            if index is None:
                index = known[position] = len(self.shards)
                self.shards.append(self._distinct_shards(key)[position])
            ids.append(index)
        return ids


@dataclass
class PlannedProgram:
    """What the plan pass leaves: the plan of every destination shard, beside the symbolic
    tensors it was made from (other boxes of the outputs are planned from them on demand)."""

    tensors: SymbolicTensors
    plan: Plan

    def print(self, printer: Printer) -> None:
        """The plan, then the notes the compiler made on the way."""
        printer.print_plan(self.plan)
        printer.print_notes(self.plan.notes)


def run(tensors: SymbolicTensors, ctx: CompileContext) -> PlannedProgram:
    return PlannedProgram(tensors, Planner(tensors, ctx).plan())


def destination_shards(tensors: SymbolicTensors, ctx: CompileContext) -> list[ShardDesc]:
    """The shards to plan: the declared destination's, or without one every output whole,
    in the dtype its casts produce (spec 7.2)."""
    if ctx.destination is not None:
        return [shard for shards in ctx.destination.values() for shard in shards]
    return [ShardDesc.full(name, tensor.shape, output_dtype(name, tensor))
            for name, tensor in sorted(tensors.outputs.items()) if tensor is not None]


def output_dtype(name: str, tensor: Tensor) -> str | None:
    """Without a destination, an output's dtype is the one its casts produce (spec 7.2)."""
    last = set()
    for piece in tensor.piece_map.pieces:
        casts = [op for op in piece.ops if isinstance(op, str) and op in CAST_TARGETS]
        if casts:
            last.add(casts[-1])
    if len(last) > 1:
        raise ValidationError(f"the pieces of output '{name}' are cast to different dtypes "
                              f"({', '.join(sorted(last))})",
                              hint="Cast the whole tensor after assembling it.")
    return last.pop() if last else tensor.dtype


class Planner:
    """Plans boxes of the outputs: answers (the pieces that fill a box), checks, copies.

    A big model's keys are planned alike by the thousand, so the planner remembers, keyed
    by values only (what is remembered is right for whatever asks with an equal key):

    - ``_distinct``: sharding number of a source key -> positions of its distinct shards
      (None: all);
    - ``_source_shards``: source key -> its distinct shards;
    - ``_reads_memo``: (source box of an entry, its axis order, sharding number of the
      source key) -> the reads of that box from the key's distinct shards;
    - ``_casts_memo``: (ops, source dtype, destination dtype) -> the rounding steps;
    - ``_key_memo``: (the output's piece map, the optimizer suffix, sharding numbers of the
      keys its slots read, sharding number of the destination shards planned, which slots
      read the same key) -> (reads, copies) of all those shards, sources as positions, so
      that another key planned alike only renames them. The piece map is a value (its
      shape and pieces), and a key's names enter only through the sharding numbers and
      the slots that repeat, which is all the copies depend on. Not used when the program
      deletes a source key (`X -> _`): what is read then depends on the names;
    - ``_answers_memo``: the same key -> the answers of all those shards (`answer_declared`)."""

    def __init__(self, tensors: SymbolicTensors, ctx: CompileContext) -> None:
        self.ctx = ctx
        self.state = tensors
        self._distinct: dict[int, list[int] | None] = {}
        self._source_shards: dict[str, list[ShardDesc]] = {}
        self._reads_memo: dict[tuple, list[_ShardRead]] = {}
        self._casts_memo: dict[tuple, tuple[str, ...]] = {}
        self._key_memo: dict[tuple, _KeyPlan] = {}
        self._answers_memo: dict[tuple, list[list[Entry]]] = {}
        #: whether a destination of no dtype, filled from another, was already reported
        self._untyped_told = False

    # -- answers -------------------------------------------------------------------------
    def tensor_for(self, key: str) -> Tensor | None:
        model_key = split_optimizer_suffix(key)[0]
        if model_key not in self.state.outputs:
            raise ValidationError(
                f"'{model_key}' is not a destination of this program",
                hint="With a destination given, every destination key is an output; without "
                     "one, only tensors that no statement consumes are.")
        return self.state.outputs[model_key]

    def _raw_entries(self, target: ShardDesc, tensor: Tensor, suffix: str | None
                     ) -> list[Entry]:
        lo = target.global_offset
        hi = tuple(map(add, lo, target.local_shape))
        if suffix not in BETA_POW_SUFFIXES and len(lo) != len(tensor.shape):
            raise ValidationError(
                f"destination {_describe(target)} has {len(lo)} dimensions, but the program "
                f"makes it with {len(tensor.shape)} (shape {list(tensor.shape)})")
        if suffix in BETA_POW_SUFFIXES:
            found = [k for k in dict.fromkeys(tensor.keys[p.slot]
                                              for p in tensor.piece_map.pieces)
                     if k not in self.state.removed]
            if not found:
                return []
            if len(found) > 1:
                self.ctx.note(f"'{target.key}' comes from several parameters "
                              f"({', '.join(found)}); its accumulator is copied from "
                              f"'{found[0]}'")
            slot = tensor.keys.index(found[0])
            return [Entry(slot, lo, hi, lo, hi, (), None)]
        entries = symbolic.intersect(tensor.piece_map, lo, hi)
        removed = self.state.removed
        if removed:
            keys = tensor.keys
            entries = [e for e in entries if keys[e.slot] not in removed]
        return entries

    def answer(self, target: ShardDesc) -> Answer | None:
        """The pieces that fill ``target``, with the source keys they read; None for a
        destination declared with `_ -> X`."""
        tensor = self.tensor_for(target.key)
        if tensor is None:
            return None
        suffix = split_optimizer_suffix(target.key)[1] or ""
        keys = tensor.keys
        return [(keys[e.slot] + suffix, e)
                for e in self._raw_entries(target, tensor, suffix or None)]

    # -- validation ----------------------------------------------------------------------
    def check(self, target: ShardDesc, answer: Answer) -> None:
        """Refuse what would leave wrong bytes in ``target`` (spec 0.3)."""
        tensor = self.tensor_for(target.key)
        assert tensor is not None, "a destination declared with `_ -> X` has no answer"
        self._check(target, tensor, [(key, e.ops) for key, e in answer],
                    [(e.target_lo, e.target_hi, key) for key, e in answer])

    def _check(self, target: ShardDesc, tensor: Tensor, reads, boxes) -> None:
        _, suffix = split_optimizer_suffix(target.key)
        if suffix not in BETA_POW_SUFFIXES and target.global_shape != tensor.shape:
            raise ValidationError(
                f"destination '{target.key}' is declared with global shape "
                f"{list(target.global_shape)}, but the program produces {list(tensor.shape)}",
                self._writer_span(target), hint=self._shape_hint(target))
        for source_key, ops in reads:
            shards = self.ctx.source.get(source_key)
            if not shards:
                states = sorted(k for k in self.ctx.source
                                if split_optimizer_suffix(k)[0] == source_key)
                hint = (f"The source holds only optimizer states of '{source_key}' "
                        f"({', '.join(states)}), not the parameter itself." if states else
                        "Optimizer states follow their parameter only where the source has "
                        "them; give the destination no such key, or add it to the source.")
                raise ValidationError(
                    f"destination {_describe(target)} needs '{source_key}', which the "
                    "source does not have", self._writer_span(target), hint=hint)
            produced = dtype_after(ops, shards[0].dtype)
            if target.dtype is not None and produced is not None and produced != target.dtype:
                raise ValidationError(
                    f"destination {_describe(target)} is {target.dtype}, but "
                    f"'{source_key}' {_how(ops)} {produced}", self._writer_span(target),
                    hint=f"Cast to the destination's dtype: `... -> {target.key}, "
                         f"dtype='{target.dtype}'` (or declare the destination {produced}).")
            if target.dtype is None and produced not in (None, "float32"):
                self._untyped(target, source_key, ops, produced)
        self._check_coverage(target, tensor, boxes)

    def _untyped(self, target: ShardDesc, source_key: str, ops, produced: str) -> None:
        """A destination shard of no dtype is written as float32, as Paddle reads None; filled
        from a tensor of another dtype, that is a cast nobody wrote (a float64 or bfloat16
        source, or a list whose dtypes were left out): a mistake, told once."""
        if self._untyped_told:
            return
        self._untyped_told = True
        self.ctx.mistake(ValidationError(
            f"destination {_describe(target)} gives no dtype, so it is written as float32, "
            f"but '{source_key}' {_how(ops)} {produced}", self._writer_span(target),
            hint=f"Give the destination its dtype ('{produced}' keeps it), or cast: `... -> "
                 f"{target.key}, dtype='float32'`; --lenient (strict=False) writes float32, "
                 "as Paddle reads a missing dtype."))

    def _shape_hint(self, target: ShardDesc) -> str:
        writer = self._writer(target)
        # statements keep their written sides: run backwards, a concat's inputs are written
        if self.ctx.reverse and writer is not None and len(writer.left) > 1 \
                and len(writer.right) == 1 and writer.attribute("axis") is not None:
            return (f"Run backwards, this concat splits '{writer.right[0].text}' into "
                    f"{len(writer.left)} equal parts, as Paddle does, so parts of unequal "
                    "sizes get no inverse from it. Write the backward mapping by hand: split "
                    "into equal parts of a size that divides every part, then join them.")
        return ("Declare the destination with the shape the statements make, or change the "
                "statements (a missing ^T or permute?).")

    def _writer(self, target: ShardDesc) -> Statement | None:
        """The statement that wrote ``target``'s key (its parameter's, for a state)."""
        return self.state.writers.get(split_optimizer_suffix(target.key)[0])

    def _writer_span(self, target: ShardDesc):
        writer = self._writer(target)
        return writer.span if writer is not None else None

    def _check_coverage(self, target: ShardDesc, tensor: Tensor, boxes) -> None:
        """Every element of ``target`` written exactly once; boxes are (lo, hi, source key)."""
        wanted = prod(target.local_shape)
        covered = sum([prod(map(sub, hi, lo)) for lo, hi, _ in boxes])
        ordered = [] if len(boxes) < 2 or _side_by_side(boxes) else sorted(boxes)
        for i, (lo, hi, key) in enumerate(ordered):
            for lo2, hi2, key2 in ordered[i + 1:]:
                if lo2[0] >= hi[0]:
                    break
                if all(max(a, c) < min(b, d) for a, b, c, d in zip(lo, hi, lo2, hi2)):
                    raise ValidationError(
                        f"destination {_describe(target)} would be written twice: by "
                        f"'{key}' and by '{key2}'")
        if covered != wanted:
            sources = tensor.source_keys()
            related = [(f"'{k}' is deleted here", s.span)
                       for k, s in self.state.removed.items() if k in sources]
            name = split_optimizer_suffix(target.key)[0]
            raise ValidationError(
                f"{wanted - covered} of the {wanted} elements of destination "
                f"{_describe(target)} are written by no statement", self._writer_span(target),
                related=related,
                hint=f"Map a source to them, or declare the destination empty with "
                     f"`_ -> {name}` to leave it as it is.")

    # -- source shards -------------------------------------------------------------------
    def source_shards(self, key: str) -> list[ShardDesc]:
        """The distinct shards of a source key (replicas once)."""
        shards = self._source_shards.get(key)
        if shards is not None:
            return shards
        listed = self.ctx.source[key]
        sharding = self.ctx.source_shardings[key]
        if sharding in self._distinct:
            positions = self._distinct[sharding]
        else:
            positions = self._distinct[sharding] = _distinct_positions(listed)
        distinct = listed if positions is None else [listed[i] for i in positions]
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
    def _key_reads(self, key: str, sharding: int
                   ) -> tuple[Tensor | None, str, Sequence[str], tuple[int, ...] | None, tuple]:
        """For the shards of destination ``key`` (``sharding``: their sharding number): its
        tensor (None: declared with `_ -> X`), optimizer suffix, the keys its slots read,
        which slots read the same key (None: one slot) and the memo key of its plan."""
        model_key, suffix = split_optimizer_suffix(key)
        outputs = self.state.outputs
        tensor = outputs[model_key] if model_key in outputs else self.tensor_for(key)
        if tensor is None:
            return None, "", (), None, ()
        keys = tensor.keys
        read_keys = [k + suffix for k in keys] if suffix else keys
        # which slots read the same key: its reads are grouped by key in the memo
        same = None if len(read_keys) == 1 else tuple(map(read_keys.index, read_keys))
        memo_key = (tensor.piece_map, suffix,
                    tuple(map(self.ctx.source_shardings.get, read_keys)), sharding, same)
        return tensor, suffix or "", read_keys, same, memo_key

    def answer_declared(self) -> dict[str, tuple[list[list[Entry]], Sequence[str]]]:
        """Destination key -> the answer of each of its declared shards, in listed order,
        with the keys the answers' slots read: every shard checked as `plan` checks it (the
        same errors, in the same order), but no copies worked out, for the Paddle drop-in,
        which answers queries from these."""
        assert self.ctx.destination is not None, "answers of a declared destination"
        removed = self.state.removed
        answered = {}
        for key, shards in self.ctx.destination.items():
            tensor, suffix, read_keys, _, memo_key = self._key_reads(
                key, self.ctx.destination_shardings[key])
            if tensor is None:
                continue
            answers = None if removed else self._answers_memo.get(memo_key)
            if answers is None:
                if removed or suffix in BETA_POW_SUFFIXES or not self._reads_sound(
                        tensor, read_keys, shards):
                    answers = []
                    for target in shards:
                        entries = self._raw_entries(target, tensor, suffix)
                        self._check_entries(target, tensor, suffix, entries)
                        answers.append(entries)
                else:
                    answers = self._sound_answers(shards, tensor, read_keys)
                if not removed:
                    self._answers_memo[memo_key] = answers
            answered[key] = (answers, read_keys)
        return answered

    def _reads_sound(self, tensor: Tensor, read_keys: Sequence[str],
                     shards: Sequence[ShardDesc]) -> bool:
        """Whether `_check` can refuse no shard of a key but for its coverage: each shard
        has the tensor's global shape, and every piece of the tensor reads a key the source
        has, in the dtype of each shard (False: check shard by shard, as `plan` does)."""
        shape = tensor.shape
        dtype = shards[0].dtype
        for shard in shards:  # all of the tensor's shape, in one dtype
            if shard.global_shape != shape or shard.dtype != dtype:
                return False
        source = self.ctx.source
        pieces = tensor.piece_map.pieces
        for slot, ops in ({(p.slot, p.ops) for p in pieces} if len(pieces) != 1
                          else [(pieces[0].slot, pieces[0].ops)]):
            listed = source.get(read_keys[slot])
            if not listed:
                return False
            produced = dtype_after(ops, listed[0].dtype)
            if dtype is not None and produced is not None and produced != dtype:
                return False
        return True

    def _sound_answers(self, shards: Sequence[ShardDesc], tensor: Tensor,
                       read_keys: Sequence[str]) -> list[list[Entry]]:
        """The answers of a key's shards where `_reads_sound`: only how each shard is
        covered is left to check (one piece filling the box is covered)."""
        piece_map = tensor.piece_map
        rank = len(tensor.shape)
        answers = []
        for target in shards:
            lo = target.global_offset
            if len(lo) != rank:  # refused as `plan` refuses it
                self._raw_entries(target, tensor, None)
            hi = tuple(map(add, lo, target.local_shape))
            entries = symbolic.intersect(piece_map, lo, hi)
            # the pieces of a piece map never overlap (each operation cuts, moves or lays
            # side by side boxes that do not), nor do their parts in one box: only a gap is
            # left to look for, which the elements written tell
            if (len(entries) != 1 or entries[0].target_lo != lo or entries[0].target_hi != hi
                    ) and sum([prod(map(sub, e.target_hi, e.target_lo)) for e in entries]
                              ) != prod(target.local_shape):
                self._check_coverage(target, tensor, [(e.target_lo, e.target_hi,
                                                       read_keys[e.slot]) for e in entries])
            answers.append(entries)
        return answers

    def plan(self, targets: Sequence[ShardDesc] | None = None) -> Plan:
        """Copies for every destination shard (or for ``targets``: any boxes of outputs).

        Shards are taken a key at a time: a key's copies are remembered under its tensor's
        piece map, its shards' sharding and its sources' (``_key_memo``), so the thousands
        of keys a template makes alike are worked out once and only renamed."""
        destinations = (destination_shards(self.state, self.ctx) if targets is None
                        else list(targets))
        source_index = _SourceIndex(self.source_shards)
        copies = CopyTable()
        untouched: list[int] = []
        removed = self.state.removed
        # planning the declared destination, each key's shards are one run, and their
        # sharding number is known; other targets are numbered as they come
        declared = self.ctx.destination if targets is None else None
        runs = ([(key, len(shards)) for key, shards in declared.items() if shards]
                if declared is not None else
                [(key, len(list(run))) for key, run in itertools.groupby(destinations,
                                                                           attrgetter("key"))])
        stop = 0
        for key, count in runs:
            start, stop = stop, stop + count
            shards = destinations[start:stop]
            sharding = (self.ctx.destination_shardings[key] if declared is not None
                        else self.ctx.shardings.number(shards))
            tensor, suffix, read_keys, same, memo_key = self._key_reads(key, sharding)
            if tensor is None:
                untouched.extend(range(start, stop))
                continue
            memo = None if removed else self._key_memo.get(memo_key)
            if memo is None:
                memo = self._key_copies(shards, tensor, suffix, same)
                if not removed:
                    self._key_memo[memo_key] = memo
            reads, key_copies = memo
            if len(reads) == 1:
                slot, positions = reads[0]
                ids = source_index.ids(read_keys[slot], positions)
            else:
                ids = [i for slot, positions in reads
                       for i in source_index.ids(read_keys[slot], positions)]
            copies.add(start, key_copies, ids)
        if targets is None:
            # a key dropped with `key -> _` is used as written, not forgotten
            self._note_unused_sources({shard.key for shard in source_index.shards}
                                      | set(self.state.removed))
        notes = [note.render() for note in self.ctx.notes]
        return Plan(source_index.shards, destinations, copies, notes, untouched)

    def _key_copies(self, shards: Sequence[ShardDesc], tensor: Tensor, suffix: str | None,
                    same: tuple[int, ...] | None) -> _KeyPlan:
        """The copies of one key's shards, with sources as positions in the key's distinct
        reads, so that another key laid out alike only renames them.

        The reads are listed per source key, as (the first slot that reads it, positions of
        its shards read), and numbered in that order; ``same`` gives each slot's first
        slot of the same key (None: one slot)."""
        # each copy with its read as (the first slot of its source key, shard position)
        planned = []
        for k, target in enumerate(shards):
            entries = self._raw_entries(target, tensor, suffix)
            planned += [(k, (r.source.slot if same is None else same[r.source.slot],
                             r.source.shard), r)
                        for r in self._shard_copies(target, tensor, suffix, entries)]
        by_key: dict[int, dict[int, None]] = {}
        for _, (slot, position), _ in planned:
            by_key.setdefault(slot, {})[position] = None
        reads = [(slot, tuple(positions)) for slot, positions in by_key.items()]
        number = {read: i for i, read in enumerate(
            [(slot, p) for slot, positions in reads for p in positions])}
        return reads, [(k, number[read], r.destination_start, r.shape, r.source_start,
                        r.order, r.casts) for k, read, r in planned]

    def _shard_copies(self, target: ShardDesc, tensor: Tensor, suffix: str | None,
                      entries: list[Entry]) -> list[_ShardCopy]:
        """Validate one destination shard, whose answer is ``entries``, and work out its
        copies."""
        read_keys = self._check_entries(target, tensor, suffix or "", entries)
        offset = target.global_offset
        copies = []
        for source_key, e in zip(read_keys, entries):
            shards = self.source_shards(source_key)
            casts = self._casts(e.ops, shards[0].dtype, target.dtype)
            for read in self._shard_reads(e, source_key, shards):
                copies.append(_ShardCopy(
                    _SourceShard(e.slot, read.shard),
                    tuple(t + d - o for t, d, o in zip(e.target_lo, read.target_delta,
                                                       offset)),
                    read.shape, read.source_start, e.order, casts))
        return copies

    def _check_entries(self, target: ShardDesc, tensor: Tensor, suffix: str,
                       entries: list[Entry]) -> list[str]:
        """`check` of a declared shard's answer, its pieces as slots; the keys they read."""
        keys = tensor.keys
        read_keys = [keys[e.slot] + suffix for e in entries]
        self._check(target, tensor, [(k, e.ops) for k, e in zip(read_keys, entries)],
                    [(e.target_lo, e.target_hi, k) for k, e in zip(read_keys, entries)])
        return read_keys

    def _casts(self, ops, source_dtype, destination_dtype) -> tuple[str, ...]:
        if not ops:
            return ()
        key = (ops, source_dtype, destination_dtype)
        casts = self._casts_memo.get(key)
        if casts is None:
            casts = self._casts_memo[key] = self.lower_casts(ops, source_dtype,
                                                             destination_dtype)
        return casts

    def _shard_reads(self, entry: Entry, key: str, shards: list[ShardDesc]
                     ) -> list[_ShardRead]:
        """The reads of ``entry`` from the shards of its source key (remembered per
        sharding of the source key, since models repeat them)."""
        memo_key = (entry.source_lo, entry.source_hi, entry.order,
                    self.ctx.source_shardings[key])
        result = self._reads_memo.get(memo_key)
        if result is not None:
            return result
        result = []
        for position, shard in enumerate(shards):
            lo = tuple(map(max, entry.source_lo, shard.global_offset))
            hi = tuple(min(a, o + n) for a, o, n in
                       zip(entry.source_hi, shard.global_offset, shard.local_shape))
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            delta = [a - b for a, b in zip(lo, entry.source_lo)]
            size = [b - a for a, b in zip(lo, hi)]
            if entry.order is not None:
                delta = [delta[a] for a in entry.order]
                size = [size[a] for a in entry.order]
            result.append(_ShardRead(position, tuple(delta), tuple(size),
                                     tuple(a - o for a, o in zip(lo, shard.global_offset))))
        self._reads_memo[memo_key] = result
        return result

    def _note_unused_sources(self, used: set[str]) -> None:
        unused = sorted(set(self.ctx.source) - used)
        if unused:
            shown = ", ".join(f"'{k}'" for k in unused[:5])
            more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
            self.ctx.note(f"{len(unused)} source keys are used by nothing: {shown}{more}")
