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

from aoa.collector import collector_paused
from aoa.errors import UsageError, quote
from aoa.frozen import fields_twin
from aoa.layout import ShardDesc, as_shard
from aoa.passes import Pass, propagate_shapes, share_instances, through
from aoa.passes.plan import Planner
from aoa.pipeline import Compilation, compile_in, new_context
from aoa.symbolic import Entry, Op, Permute

#: Paddle's shard descriptor; the same fields and value semantics.
ShardedWeightDesc = ShardDesc

#: one piece of a planned shard's answer: (slot, target offset, target size, source offset,
#: source size, postprocess steps or None)
_EntryForm = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...],
                   "tuple[str, ...] | None"]
#: a planned shard's answer: the form of the one piece that fills it, or a list of forms
_ShardForm = _EntryForm | list[_EntryForm]


@dataclass(frozen=True, slots=True)
class ShardMappingEntry:
    target_slice: ShardDesc
    source_slice: ShardDesc
    postprocess_list: list[str] | None = None


class _ShareWherePays:
    """share_instances as the drop-in runs it: only where it pays (`share_instances.pays`);
    a loader compiles a small model's program at every load, its templates of two
    instances each."""

    NAME = share_instances.NAME
    run = staticmethod(share_instances.run_where_it_pays)


#: the passes the drop-in runs: through shape propagation
_PASSES: tuple[Pass, ...] = tuple(_ShareWherePays if p is share_instances else p
                                  for p in through(propagate_shapes))

_EntryFields = fields_twin(ShardMappingEntry)
_ShardFields = fields_twin(ShardDesc)
_new_object = object.__new__
_shard = ShardDesc.unchecked


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
        #: ops of a piece -> Paddle's postprocess list of them, as a tuple
        self._postprocess: dict[tuple[Op, ...], tuple[str, ...]] = {}
        #: destination key -> its declared shards, the parts of each one's Paddle entries
        #: (None: declared with `_ -> X`, no entries) and the keys their slots read
        self._planned: dict[str, tuple[list[ShardDesc], list[_ShardForm] | None,
                                       Sequence[str]]] = {}
        #: the compilation and its planner, for the queries of other boxes (None: not
        #: made since construction, see `compilation`)
        self._compilation: Compilation | None = None
        self._planner: Planner | None = None
        # one pause of the collector for all of the construction: each pause ends with a
        # collection of what was made in it, and the descriptions read first are made by
        # the hundred
        with collector_paused():
            self._build(source_state_shard_info, destination_state_shard_info)

    @property
    def compilation(self) -> Compilation:
        """What the compiler made of the program. With a destination, the engine keeps only
        the answers of its shards once they are planned, not the statements, tensors and
        memos behind them (a thousand objects for a small model, which the collector would
        walk and which no query of a declared shard reads): they are made again, alike,
        when first asked (a query of another box asks)."""
        if self._compilation is None:
            with collector_paused():
                self._compilation = compile_in(
                    new_context(self.source, self.destination, self.reverse),
                    self.statements, passes=_PASSES)
        return self._compilation

    def _boxes_planner(self) -> Planner:
        """The planner of boxes that are no declared shard."""
        if self._planner is None:
            compilation = self.compilation
            self._planner = Planner(compilation.tensors, compilation.ctx)
        return self._planner

    def _build(self, source_state_shard_info: Mapping,
               destination_state_shard_info: Mapping | None) -> None:
        """Compile, then answer (so check) every destination shard."""
        ctx = new_context(source_state_shard_info, destination_state_shard_info, self.reverse)
        self.source = ctx.source
        self.destination = ctx.destination
        compilation = compile_in(ctx, self.statements, passes=_PASSES)
        if self.destination is None:  # every query is of a box planned when asked
            self._compilation = compilation
            return
        # every shard answered (so checked) here: wrong programs are refused before any
        # byte moves, not at the query that hits them; the entries' parts are made here
        # too, not query by query: objects by the hundred thousand that outlive the
        # queries would set the collector walking them in the middle of them
        answered = Planner(compilation.tensors, ctx).answer_declared()
        forms: dict[int, list[_ShardForm]] = {}  # by id of a key's answers
        for key, shards in self.destination.items():
            answers, read_keys = answered.get(key, (None, ()))
            key_forms = None
            if answers is not None:  # keys laid out alike share their answers
                key_forms = forms.get(id(answers))
                if key_forms is None:
                    key_forms = forms[id(answers)] = list(map(self._form, answers, shards))
            self._planned[key] = (shards, key_forms, read_keys)

    def find_shard_sources(self, target: ShardDesc) -> list[ShardMappingEntry]:
        try:  # the planned destination shard equal to ``target`` (a descriptor of any class)
            planned = self._planned.get(target.key)
            offset = target.global_offset
        except (AttributeError, TypeError):  # not a descriptor, or not a text for a key
            planned = None
        if planned is None:
            return self._answer_unplanned(as_shard(target))
        shards, forms, read_keys = planned
        position = 0
        for shard in shards:  # a few shards a key: no index needed
            if shard.global_offset == offset:
                break
            position += 1
        else:
            return self._answer_unplanned(as_shard(target))
        if (shard.local_shape != target.local_shape or shard.global_shape
                != target.global_shape or shard.dtype != target.dtype):
            return self._answer_unplanned(as_shard(target))
        if forms is None:
            return []
        form = forms[position]
        source = self.source
        if isinstance(form, tuple):  # the one piece that fills the shard: its entry made
            # here, by plain stores (`_read_entry`, inline: a query a shard)
            slot, _, _, source_lo, source_size, steps = form
            source_key = read_keys[slot]
            read = source[source_key][0]
            source_shard = _new_object(_ShardFields)
            source_shard.key, source_shard.local_shape = source_key, source_size
            source_shard.global_shape, source_shard.global_offset = (read.global_shape,
                                                                     source_lo)
            source_shard.dtype = read.dtype
            source_shard.__class__ = ShardDesc
            entry = _new_object(_EntryFields)
            entry.target_slice, entry.source_slice = shard, source_shard
            entry.postprocess_list = None if steps is None else list(steps)
            entry.__class__ = ShardMappingEntry
            return [entry]
        result = []
        key, global_shape, dtype = shard.key, shard.global_shape, shard.dtype
        for slot, target_lo, target_size, source_lo, source_size, steps in form:
            source_key = read_keys[slot]
            result.append(_read_entry(_shard(key, target_size, global_shape, target_lo, dtype),
                                      source_key, source_size, source[source_key][0],
                                      source_lo, steps))
        return result

    def _form(self, answer: Sequence[Entry], shard: ShardDesc) -> _ShardForm:
        """The parts of the Paddle entries of a planned shard's pieces. The one piece of a
        shard's answer fills it (every answer was checked to cover its shard, inside it):
        its form stands alone, not in a list, its sizes the shard's, and the source's too
        where the piece is not permuted (no new objects of their own for every shard)."""
        if len(answer) == 1 and answer[0].target_lo == shard.global_offset:
            (entry,) = answer
            size = shard.local_shape
            return (entry.slot, entry.target_lo, size, entry.source_lo,
                    size if entry.order is None
                    else tuple(map(sub, entry.source_hi, entry.source_lo)),
                    self._postprocess_steps(entry.ops))
        return [(entry.slot, entry.target_lo, tuple(map(sub, entry.target_hi, entry.target_lo)),
                 entry.source_lo, tuple(map(sub, entry.source_hi, entry.source_lo)),
                 self._postprocess_steps(entry.ops)) for entry in answer]

    def _answer_unplanned(self, target: ShardDesc) -> list[ShardMappingEntry]:
        """A box the plan did not cover: answered and checked now."""
        planner = self._boxes_planner()
        answer = planner.answer(target)
        if answer is None:
            return []
        planner.check(target, answer)
        result = []
        for source_key, entry in answer:
            read = self.source[source_key][0]
            result.append(_entry(
                _shard(target.key, tuple(map(sub, entry.target_hi, entry.target_lo)),
                       target.global_shape, entry.target_lo, target.dtype),
                _shard(source_key, tuple(map(sub, entry.source_hi, entry.source_lo)),
                       read.global_shape, entry.source_lo, read.dtype),
                self._postprocess_steps(entry.ops)))
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


def _entry(target: ShardDesc, source: ShardDesc, steps: tuple[str, ...] | None
           ) -> ShardMappingEntry:
    """A ShardMappingEntry, its postprocess list a new list of ``steps`` (None: none)."""
    entry = _new_object(_EntryFields)
    entry.target_slice, entry.source_slice = target, source
    entry.postprocess_list = None if steps is None else list(steps)
    entry.__class__ = ShardMappingEntry
    return entry


def _read_entry(target: ShardDesc, source_key: str, source_size: tuple[int, ...],
                read: ShardDesc, source_lo: tuple[int, ...], steps: tuple[str, ...] | None
                ) -> ShardMappingEntry:
    """`_entry` of a planned piece: its source descriptor (of ``source_key``, laid out as
    the source's ``read``) made here with the entry, by plain stores, as
    `ShardDesc.unchecked` makes one (a query makes these by the hundred thousand)."""
    source = _new_object(_ShardFields)
    source.key, source.local_shape, source.global_shape = (source_key, source_size,
                                                           read.global_shape)
    source.global_offset, source.dtype = source_lo, read.dtype
    source.__class__ = ShardDesc
    entry = _new_object(_EntryFields)
    entry.target_slice, entry.source_slice = target, source
    entry.postprocess_list = None if steps is None else list(steps)
    entry.__class__ = ShardMappingEntry
    return entry
