"""Sources stored block-quantized: fp8 weights beside one scale per block (DeepSeek-V3 and
Kimi-K2 ship ``W`` in float8_e4m3fn with ``W_scale_inv``, float32, one per 128 x 128 block,
the last ones partial). A weight's value is its stored value times its block's scale.

The compiler plans copies of ``W`` as of any tensor; this step then gives each source shard
that a copy dequantizes (reads into another dtype) its second source: the shard of the scales
that covers its blocks, with the block (`aoa.plan.ScaleRead`). The kernel multiplies in the
same pass as the copy. The mapping itself never sees those scales (`without_scales`). A copy
that keeps the stored dtype moves the stored bytes; the scales then travel as tensors of
their own, which the mapping names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aoa.errors import PlanError
from aoa.layout import ShardDesc
from aoa.plan import Plan, ScaleRead

#: The dtypes a quantized weight is stored in; dequantizing into one would need new scales.
FP8 = frozenset({"float8_e4m3fn", "float8_e5m2"})


@dataclass(frozen=True)
class Quantized:
    """A source key stored quantized: where its scales are and the elements per block along
    its last axes (``(128, 128)``; axes before those have blocks of 1)."""

    scale_key: str
    block: tuple[int, ...]

    def block_of(self, key: str, ndim: int) -> tuple[int, ...]:
        if len(self.block) > ndim:
            raise PlanError(f"'{key}' has {ndim} axes, fewer than its scale blocks "
                            f"{list(self.block)}")
        return (1,) * (ndim - len(self.block)) + tuple(self.block)


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    """The scales of a tensor of ``shape``: one per block, a partial last block included."""
    return tuple(-(-n // b) for n, b in zip(shape, block))


def without_scales(shards: Mapping[str, Sequence[ShardDesc]],
                   quantized: Mapping[str, Quantized] | None
                   ) -> Mapping[str, Sequence[ShardDesc]]:
    """The source as a mapping sees it: the scales of the quantized keys are read by the
    dequantization, never by a statement."""
    if not quantized:
        return shards
    scales = {spec.scale_key for spec in quantized.values()}
    return {key: listed for key, listed in shards.items() if key not in scales}


def read_scales(plan: Plan, source: Mapping[str, Sequence[ShardDesc]],
                quantized: Mapping[str, Quantized]) -> Plan:
    """``plan`` with a scale shard (from ``source``) for each quantized source shard a copy
    dequantizes. Refuses a missing scale shard, scales of the wrong shape, and a copy that
    would dequantize into an fp8 dtype."""
    dequantized: set[int] = set()
    for copy in plan.copies:
        shard = plan.sources[copy.source]
        if shard.key not in quantized:
            continue
        into = plan.destinations[copy.destination]
        if into.dtype == shard.dtype:
            continue
        if into.dtype in FP8:
            raise PlanError(f"'{shard.key}' is stored quantized ({shard.dtype} with scales "
                            f"'{quantized[shard.key].scale_key}'); copying it into "
                            f"'{into.key}' as {into.dtype} would need new scales",
                            hint="Keep its dtype (the scales travel beside it), or "
                                 "dequantize into bfloat16, float16 or float32.")
        dequantized.add(copy.source)
    if not dequantized:
        return plan
    sources = list(plan.sources)
    index = {(s.key, s.global_offset, s.local_shape): i for i, s in enumerate(sources)}
    scales = dict(plan.scales)
    for position in sorted(dequantized):
        shard = sources[position]
        spec = quantized[shard.key]
        block = spec.block_of(shard.key, len(shard.global_shape))
        scale = _covering_shard(shard, spec.scale_key, block, source.get(spec.scale_key, ()))
        where = (scale.key, scale.global_offset, scale.local_shape)
        if where not in index:
            index[where] = len(sources)
            sources.append(scale)
        scales[position] = ScaleRead(index[where], block)
    return dataclasses.replace(plan, sources=sources, scales=scales)


def _covering_shard(shard: ShardDesc, scale_key: str, block: tuple[int, ...],
                    candidates: Sequence[ShardDesc]) -> ShardDesc:
    """The shard of ``scale_key`` holding the scales of every block ``shard`` touches."""
    if not candidates:
        raise PlanError(f"'{shard.key}' is stored quantized, but the source has no "
                        f"'{scale_key}' (its scales)",
                        hint="A quantized weight means nothing without its scales: check "
                             "that the checkpoint is complete.")
    want = scale_shape(shard.global_shape, block)
    if candidates[0].global_shape != want:
        raise PlanError(f"'{scale_key}' has shape {list(candidates[0].global_shape)}, but "
                        f"'{shard.key}' {list(shard.global_shape)} in blocks of "
                        f"{list(block)} needs {list(want)}")
    first = [o // b for o, b in zip(shard.global_offset, block)]
    end = [-(-(o + n) // b) for o, n, b in zip(shard.global_offset, shard.local_shape, block)]
    for candidate in candidates:
        if all(c <= f and e <= c + n for c, n, f, e in zip(
                candidate.global_offset, candidate.local_shape, first, end)):
            return candidate
    raise PlanError(f"no shard of '{scale_key}' holds the scales of '{shard.key}' at "
                    f"{list(shard.global_offset)} (blocks {first} to {end})",
                    hint="Scales are split with their weights, whole blocks to a shard.")
