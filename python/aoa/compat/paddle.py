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
from aoa.pipeline import compile_in, new_context
from aoa.symbolic import Op, Permute

#: Paddle's shard descriptor; the same fields and value semantics.
ShardedWeightDesc = ShardDesc

#: a shard's box and dtype: (global_offset, local_shape, global_shape, dtype)
_Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], "str | None"]
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

    With a destination, every shard of it is planned (and so checked) here, once; a query
    for one of them, by an equal descriptor of any class, is answered from the pieces that
    planning found, and any other box is checked when asked."""

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
        if self.destination is not None:
            # every shard planned (so checked) here: wrong programs are refused before any
            # byte moves, not at the query that hits them
            self.compilation.plan(planner=self._planner)
        #: destination key -> position of each of its planned shards by box and dtype
        self._positions: dict[str, dict[_Box, int]] = {}
        #: (id of a planned key's answers, position) -> the Paddle entries' parts
        self._forms: dict[tuple[int, int], list[_EntryForm]] = {}
        #: ops of a piece -> Paddle's postprocess list of them, as a tuple
        self._postprocess: dict[tuple[Op, ...], tuple[str, ...]] = {}

    def find_shard_sources(self, target: ShardDesc) -> list[ShardMappingEntry]:
        planned = self._planned_position(target)
        if planned is None:
            return self._answer_unplanned(as_shard(target))
        shard, position = planned
        answers = self._planner.planned_answers.get(shard.key)
        if answers is None:  # declared with `_ -> X`
            return []
        key_answers, read_keys = answers
        form = self._forms.get((id(key_answers), position))
        if form is None:
            form = self._forms[id(key_answers), position] = [
                (entry.slot, entry.target_lo, tuple(map(sub, entry.target_hi, entry.target_lo)),
                 entry.source_lo, tuple(map(sub, entry.source_hi, entry.source_lo)),
                 self._postprocess_steps(entry.ops))
                for entry in key_answers[position]]
        unchecked = _unchecked
        source = self.source
        if len(form) == 1:  # the one piece of a planned shard covers all of it
            slot, _, _, source_lo, source_size, steps = form[0]
            source_key = read_keys[slot]
            read = source[source_key][0]
            return [_mapping_entry(
                shard,
                unchecked(source_key, source_size, read.global_shape, source_lo, read.dtype),
                None if steps is None else list(steps))]
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

    def _planned_position(self, target: object) -> tuple[ShardDesc, int] | None:
        """The planned destination shard equal to ``target`` (a descriptor of any class
        with the same fields) and its position among its key's, if there is one."""
        if self.destination is None:
            return None
        try:
            key = target.key  # type: ignore[attr-defined]
            positions = self._positions.get(key)
            if positions is None:
                positions = self._positions[key] = {
                    (s.global_offset, s.local_shape, s.global_shape, s.dtype): position
                    for position, s in enumerate(self.destination.get(key, ()))}
            position = positions.get((target.global_offset, target.local_shape,  # type: ignore
                                      target.global_shape, target.dtype))  # type: ignore
        except (AttributeError, TypeError):  # not a descriptor, or lists for boxes
            return None
        return None if position is None else (self.destination[key][position], position)

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
