"""Shard descriptions of a source checkpoint and a destination model, and the optimizer-state
suffixes that let optimizer tensors follow their parameter (spec 1.1, 1.2)."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod

from aoa.dtypes import itemsize
from aoa.errors import UsageError

#: Paddle's OPTIMIZER_STATE_NAME, in the order `split_optimizer_suffix` tries them.
OPTIMIZER_SUFFIXES = (".w_0", ".moment1_0", ".moment2_0", ".beta1_pow_acc_0", ".beta2_pow_acc_0")
BETA_POW_SUFFIXES = frozenset({".beta1_pow_acc_0", ".beta2_pow_acc_0"})
#: The suffixes whose shard counts must agree with the parameter's (spec 5.11 step 4).
SHARD_COUNT_SUFFIXES = ("", ".w_0", ".moment1_0", ".moment2_0")


@dataclass(frozen=True, slots=True)
class ShardDesc:
    """A box of ``local_shape`` at ``global_offset`` inside a tensor of ``global_shape``."""

    key: str
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    dtype: str | None = None

    def __post_init__(self) -> None:
        """Boxes become tuples and are checked once, here, so passes can trust them."""
        for field_name in ("local_shape", "global_shape", "global_offset"):
            value = getattr(self, field_name)
            if not isinstance(value, tuple):
                object.__setattr__(self, field_name, tuple(int(v) for v in value))
        _check_shard(self)

    @property
    def numel(self) -> int:
        return prod(self.local_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the box (dtype None reads as float32, as in Paddle)."""
        return prod(self.local_shape) * itemsize(self.dtype or "float32")

    def to_json(self) -> dict:
        return {"key": self.key, "local_shape": list(self.local_shape),
                "global_shape": list(self.global_shape),
                "global_offset": list(self.global_offset), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Mapping) -> ShardDesc:
        return cls(data["key"], tuple(data["local_shape"]), tuple(data["global_shape"]),
                   tuple(data["global_offset"]), data.get("dtype"))

    @classmethod
    def full(cls, key: str, shape: Sequence[int], dtype: str | None = None) -> ShardDesc:
        """An unsharded tensor: one shard covering everything."""
        return cls(key, tuple(shape), tuple(shape), (0,) * len(shape), dtype)


ShardInfo = Mapping[str, Sequence[ShardDesc]]


@functools.lru_cache(maxsize=1 << 20)
def split_optimizer_suffix(key: str) -> tuple[str, str | None]:
    """(model-state key, suffix) for the first suffix in Paddle's order that ``key`` ends with."""
    for suffix in OPTIMIZER_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    return key, None


def model_state_keys(info: ShardInfo | None) -> frozenset[str]:
    return frozenset([split_optimizer_suffix(key)[0] for key in info or ()])


def shard_count(info: ShardInfo | None, key: str) -> tuple[int | None, dict[str, int]]:
    """Distinct global offsets of ``key`` and its optimizer states (replicas count once).

    Returns (count, per-key counts); count is None when no such key is present."""
    counts = {}
    for suffix in SHARD_COUNT_SUFFIXES:
        shards = (info or {}).get(key + suffix)
        if shards:
            counts[key + suffix] = len({shard.global_offset for shard in shards})
    values = set(counts.values())
    return (values.pop() if len(values) == 1 else None), counts


def normalize_shard_info(info: Mapping | None, what: str) -> dict[str, list[ShardDesc]] | None:
    """Accept ShardDesc objects, Paddle's ShardedWeightDesc (same attribute names) or
    case.json-style dicts; check each description's key and box."""
    if info is None:
        return None
    result: dict[str, list[ShardDesc]] = {}
    for key, shards in info.items():
        converted = [as_shard(shard) for shard in _as_list(shards)]
        for shard in converted:
            if shard.key != key:
                raise UsageError(f"{what} shard listed under '{key}' describes '{shard.key}'")
        result[key] = converted
    return result


def _as_list(shards) -> Iterable:
    return [shards] if not isinstance(shards, (list, tuple)) else shards


def as_shard(shard) -> ShardDesc:
    """A ShardDesc from one, from Paddle's ShardedWeightDesc, or from a case.json dict."""
    if isinstance(shard, ShardDesc):
        return shard
    if isinstance(shard, Mapping):
        return ShardDesc.from_json(shard)
    return ShardDesc(shard.key, tuple(shard.local_shape), tuple(shard.global_shape),
                     tuple(shard.global_offset), getattr(shard, "dtype", None))


def _check_shard(shard: ShardDesc) -> None:
    key = shard.key
    offsets, sizes, totals = shard.global_offset, shard.local_shape, shard.global_shape
    if len(offsets) == len(sizes) == len(totals) and all(
            o >= 0 and n >= 0 and o + n <= t for o, n, t in zip(offsets, sizes, totals)):
        return
    rank = len(shard.global_shape)
    if len(shard.local_shape) != rank or len(shard.global_offset) != rank:
        raise UsageError(f"shard of '{key}' has local shape {list(shard.local_shape)}, "
                         f"global shape {list(shard.global_shape)} and offset "
                         f"{list(shard.global_offset)} of different ranks")
    for axis, (offset, size, total) in enumerate(
            zip(shard.global_offset, shard.local_shape, shard.global_shape)):
        if offset < 0 or size < 0 or offset + size > total:
            raise UsageError(f"shard of '{key}' reaches past its global shape on axis "
                             f"{axis}: offset {offset} + size {size} > {total}")
