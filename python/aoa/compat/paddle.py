"""A drop-in for PaddlePaddle 3.3.1's FlexCheckpoint AOA engine.

Same constructor arguments and the same `find_shard_sources` answers (Paddle's
ShardMappingEntry form: global boxes, postprocess lists of permutation strings and dtype
names), computed by aoa's compiler. Where Paddle would silently produce wrong bytes, the
engine raises an AoaError instead (spec 0.3); queries never change state (spec 0.4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import sub

from aoa.errors import UsageError, quote
from aoa.layout import ShardDesc, as_shard
from aoa.passes import propagate_shapes, through
from aoa.passes.plan import Planner
from aoa.pipeline import collector_paused, compile_in, new_context
from aoa.symbolic import Entry, Op, Permute

#: Paddle's shard descriptor; the same fields and value semantics.
ShardedWeightDesc = ShardDesc

#: one piece of a planned shard's answer: (slot, target offset, target size, source offset,
#: source size, postprocess steps or None)
_EntryForm = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...],
                   "tuple[str, ...] | None"]


@dataclass(frozen=True, slots=True)
class ShardMappingEntry:
    target_slice: ShardDesc
    source_slice: ShardDesc
    postprocess_list: list[str] | None = None


_unchecked = ShardDesc.unchecked
_new_object = object.__new__
_set_target, _set_source, _set_postprocess = (
    getattr(ShardMappingEntry, name).__set__
    for name in ("target_slice", "source_slice", "postprocess_list"))


class AOAEngine:
    """`AOAEngine(aoa_config, source_state_shard_info, destination_state_shard_info)`.

    ``aoa_config`` keys: ``aoa_statements`` (list of strings), ``aoa_config_reverse``;
    others (``enable_traceback``) are accepted and ignored: aoa errors always say where
    they come from.

    With a destination, every shard of it is answered (and so checked) here, once; a query
    for one of them, by an equal descriptor of any class, is answered from the pieces found
    then, and any other box is checked when asked."""

    def __init__(self, aoa_config: Mapping, source_state_shard_info: Mapping,
                 destination_state_shard_info: Mapping | None = None) -> None:
        if not isinstance(aoa_config, Mapping):
            raise UsageError(f"aoa_config must be a dict with 'aoa_statements', not "
                             f"{quote(aoa_config)}")
        statements = aoa_config.get("aoa_statements", [])
        if isinstance(statements, str):  # list() would make one statement per character
            raise UsageError("aoa_statements must be a list of statement texts, not one text",
                             hint="Write [\"a -> b\", ...], as Paddle takes it.")
        self.statements: Sequence[str] = list(statements)
        self.reverse = bool(aoa_config.get("aoa_config_reverse", False))
        ctx = new_context(source_state_shard_info, destination_state_shard_info, self.reverse)
        self.source = ctx.source
        self.destination = ctx.destination
        self.compilation = compile_in(ctx, self.statements, passes=through(propagate_shapes))
        self._planner = Planner(self.compilation.tensors, ctx)
        #: destination key -> the answers of its declared shards and the keys they read
        self._planned: dict[str, tuple[list[list[Entry]], Sequence[str]]] = {}
        #: ops of a piece -> Paddle's postprocess list of them, as a tuple
        self._postprocess: dict[tuple[Op, ...], tuple[str, ...]] = {}
        #: id of a planned key's answers -> the Paddle entries' parts, by position
        self._forms: dict[int, list[list[_EntryForm]]] = {}
        #: (key, global_offset, local_shape, global_shape, dtype) of each destination shard
        #: -> the shard and its position among its key's
        self._boxes: dict[tuple, tuple[ShardDesc, int]] = {}
        with collector_paused():
            if self.destination is not None:
                # every shard answered (so checked) here: wrong programs are refused before
                # any byte moves, not at the query that hits them
                self._planned = self._planner.answer_declared()
            # made here, with what was planned, not query by query: hundreds of thousands
            # of objects that outlive the queries would set the collector walking the
            # whole plan in the middle of them
            for shards in (self.destination or {}).values():
                for position, s in enumerate(shards):
                    self._boxes[s.key, s.global_offset, s.local_shape, s.global_shape,
                                s.dtype] = (s, position)
            for key_answers, _ in self._planned.values():
                if id(key_answers) not in self._forms:
                    self._forms[id(key_answers)] = [self._form(answer)
                                                    for answer in key_answers]

    def find_shard_sources(self, target: ShardDesc) -> list[ShardMappingEntry]:
        try:  # the planned destination shard equal to ``target`` (a descriptor of any class)
            planned = self._boxes.get((target.key, target.global_offset, target.local_shape,
                                 target.global_shape, target.dtype))
        except (AttributeError, TypeError):  # not a descriptor, or lists for boxes
            planned = None
        if planned is None:
            return self._answer_unplanned(as_shard(target))
        shard, position = planned
        answers = self._planned.get(shard.key)
        if answers is None:  # declared with `_ -> X`
            return []
        key_answers, read_keys = answers
        form = self._forms[id(key_answers)][position]
        unchecked = _unchecked
        source = self.source
        if len(form) == 1:  # the one piece of a planned shard covers all of it
            slot, _, _, source_lo, source_size, steps = form[0]
            source_key = read_keys[slot]
            read = source[source_key][0]
            entry = _new_object(ShardMappingEntry)
            _set_target(entry, shard)
            _set_source(entry, unchecked(source_key, source_size, read.global_shape, source_lo,
                                         read.dtype))
            _set_postprocess(entry, None if steps is None else list(steps))
            return [entry]
        result = []
        key, global_shape, dtype = shard.key, shard.global_shape, shard.dtype
        for slot, target_lo, target_size, source_lo, source_size, steps in form:
            source_key = read_keys[slot]
            read = source[source_key][0]
            result.append(_mapping_entry(
                unchecked(key, target_size, global_shape, target_lo, dtype),
                unchecked(source_key, source_size, read.global_shape, source_lo, read.dtype),
                None if steps is None else list(steps)))
        return result

    def _form(self, answer: Sequence[Entry]) -> list[_EntryForm]:
        """The parts of the Paddle entries of a planned shard's pieces."""
        return [(entry.slot, entry.target_lo, tuple(map(sub, entry.target_hi, entry.target_lo)),
                 entry.source_lo, tuple(map(sub, entry.source_hi, entry.source_lo)),
                 self._postprocess_steps(entry.ops)) for entry in answer]

    def _answer_unplanned(self, target: ShardDesc) -> list[ShardMappingEntry]:
        """A box the plan did not cover: answered and checked now."""
        answer = self._planner.answer(target)
        if answer is None:
            return []
        self._planner.check(target, answer)
        result = []
        for source_key, entry in answer:
            read = self.source[source_key][0]
            steps = self._postprocess_steps(entry.ops)
            result.append(_mapping_entry(
                ShardDesc.unchecked(target.key, tuple(map(sub, entry.target_hi, entry.target_lo)),
                                    target.global_shape, entry.target_lo, target.dtype),
                ShardDesc.unchecked(source_key, tuple(map(sub, entry.source_hi, entry.source_lo)),
                                    read.global_shape, entry.source_lo, read.dtype),
                None if steps is None else list(steps)))
        return result

    def _postprocess_steps(self, ops: tuple[Op, ...]) -> tuple[str, ...] | None:
        """Paddle's postprocess list (permutation strings and dtype names, in order), as a
        tuple; None for a piece copied as it is."""
        if not ops:
            return None
        steps = self._postprocess.get(ops)
        if steps is None:
            steps = self._postprocess[ops] = tuple(
                op.text if isinstance(op, Permute) else op for op in ops)
        return steps


def _mapping_entry(target: ShardDesc, source: ShardDesc, postprocess: list[str] | None
                   ) -> ShardMappingEntry:
    """A ShardMappingEntry made without the dataclass's checks of frozen fields."""
    entry = _new_object(ShardMappingEntry)
    _set_target(entry, target)
    _set_source(entry, source)
    _set_postprocess(entry, postprocess)
    return entry
