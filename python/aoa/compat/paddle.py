"""A drop-in for PaddlePaddle 3.3.1's FlexCheckpoint AOA engine.

Same constructor arguments and the same `find_shard_sources` answers (Paddle's
ShardMappingEntry form: global boxes, postprocess lists of permutation strings and dtype
names), computed by aoa's compiler. Where Paddle would silently produce wrong bytes, the
engine raises an AoaError instead (spec 0.3); queries never change state (spec 0.4).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aoa.errors import UsageError, quote
from aoa.layout import ShardDesc, as_shard, normalize_shard_info
from aoa.passes import PIPELINE, propagate_shapes, through
from aoa.passes.plan import Planner
from aoa.pipeline import analyze
from aoa.symbolic import Op, Permute

#: Paddle's shard descriptor; the same fields and value semantics.
ShardedWeightDesc = ShardDesc


@dataclass(frozen=True)
class ShardMappingEntry:
    target_slice: ShardDesc
    source_slice: ShardDesc
    postprocess_list: list[str] | None = None


class AOAEngine:
    """`AOAEngine(aoa_config, source_state_shard_info, destination_state_shard_info)`.

    ``aoa_config`` keys: ``aoa_statements`` (list of strings), ``aoa_config_reverse``;
    others (``enable_traceback``) are accepted and ignored: aoa errors always say where
    they come from."""

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
        self.source = normalize_shard_info(source_state_shard_info, "source") or {}
        self.destination = normalize_shard_info(destination_state_shard_info, "destination")
        # With a destination, every shard is planned: wrong programs are refused before
        # any byte moves, not at the query that hits them.
        self.compilation = analyze(
            self.statements, self.source, self.destination, reverse=self.reverse,
            passes=PIPELINE if self.destination is not None else through(propagate_shapes))
        self._planner = Planner(self.compilation.tensors, self.compilation.ctx)

    def find_shard_sources(self, target: ShardDesc) -> list[ShardMappingEntry]:
        planner = self._planner
        target = as_shard(target)
        answer = planner.answer(target)
        if answer is None:
            return []
        if self.destination is None or target not in self.destination.get(target.key, ()):
            planner.check(target, answer)  # a box the plan did not validate
        result = []
        for source_key, entry in answer:
            source_shape = self.source[source_key][0].global_shape
            source_dtype = self.source[source_key][0].dtype
            result.append(ShardMappingEntry(
                ShardDesc(target.key, _size(entry.target_lo, entry.target_hi),
                          target.global_shape, entry.target_lo, target.dtype),
                ShardDesc(source_key, _size(entry.source_lo, entry.source_hi),
                          source_shape, entry.source_lo, source_dtype),
                _postprocess(entry.ops)))
        return result


def _postprocess(ops: tuple[Op, ...]) -> list[str] | None:
    """Paddle's postprocess list: permutation strings and dtype names, in order."""
    if not ops:
        return None
    return [op.text if isinstance(op, Permute) else op for op in ops]


def _size(lo: Sequence[int], hi: Sequence[int]) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(lo, hi))
