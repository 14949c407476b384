"""Shard descriptions of a source checkpoint and a destination model, and the optimizer-state
suffixes that let optimizer tensors follow their parameter (spec 1.1, 1.2)."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Protocol

from aoa.dtypes import ITEMSIZES, is_known, itemsize
from aoa.errors import PlanError, UsageError, quote
from aoa.frozen import fields_twin
from aoa.inputs import is_text
from aoa.limits import shape_problem

if TYPE_CHECKING:
    import numpy as np

#: Paddle's OPTIMIZER_STATE_NAME, in the order `split_optimizer_suffix` tries them.
OPTIMIZER_SUFFIXES = (".w_0", ".moment1_0", ".moment2_0", ".beta1_pow_acc_0", ".beta2_pow_acc_0")
BETA_POW_SUFFIXES = frozenset({".beta1_pow_acc_0", ".beta2_pow_acc_0"})
#: The suffixes whose shard counts must agree with the parameter's (spec 5.11 step 4).
SHARD_COUNT_SUFFIXES = ("", ".w_0", ".moment1_0", ".moment2_0")


#: A shard's (local shape, global shape, global offset, dtype).
ShardRow = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], "str | None"]


@dataclass(frozen=True, slots=True)
class ShardDesc:
    """A box of ``local_shape`` at ``global_offset`` inside a tensor of ``global_shape``."""

    key: str
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    dtype: str | None = None

    def __post_init__(self) -> None:
        """Boxes become tuples of ints and are checked once, here, so passes can trust
        them: a description that is not one is a UsageError naming its key."""
        boxes = (self.local_shape, self.global_shape, self.global_offset)
        if not (tuple is type(boxes[0]) is type(boxes[1]) is type(boxes[2])
                and _INT_ONLY.issuperset(map(type, boxes[0] + boxes[1] + boxes[2]))):
            for field_name, box in zip(_BOX_FIELDS, boxes):
                object.__setattr__(self, field_name, as_box(self.key, field_name, box))
        _check_shard(self)

    @classmethod
    def unchecked(cls, key: str, local_shape: tuple[int, ...], global_shape: tuple[int, ...],
                  global_offset: tuple[int, ...], dtype: str | None) -> ShardDesc:
        """A description made of parts of checked ones (a box inside a checked shard, of
        its key and dtype), so not checked again: answers to queries make them by the
        hundred thousand. Its fields are filled with plain stores into `_ShardFields` (the
        same slots), which then becomes a ShardDesc: a third of the cost of setting a frozen
        dataclass's fields through their descriptors, a call each."""
        shard = _ShardFields()
        shard.key, shard.local_shape, shard.global_shape = key, local_shape, global_shape
        shard.global_offset, shard.dtype = global_offset, dtype
        shard.__class__ = cls
        return shard

    @classmethod
    def many_unchecked(cls, keys: Iterable[str], local_shapes: Iterable[tuple[int, ...]],
                       global_shapes: Iterable[tuple[int, ...]],
                       global_offsets: Iterable[tuple[int, ...]],
                       dtypes: Iterable[str | None]) -> list[ShardDesc]:
        """`unchecked` of each row of these columns (of one length), for descriptions
        checked in bulk (checkpoint headers): made in C++ (`aoa._core.new_records`), each
        field set through its slot, half the cost of `unchecked`'s stores in a loop."""
        from aoa import _core

        return _core.new_records(cls, _FIELDS, (keys, local_shapes, global_shapes,
                                                global_offsets, dtypes))

    @classmethod
    def grouped_unchecked(cls, keys: Sequence[str], rows: Sequence[Sequence[ShardRow]]
                          ) -> ReadShardInfo:
        """{key: [`unchecked` of each of its rows]}, for descriptions checked in bulk
        (shard-info JSON), made as `many_unchecked` makes them (each key's list as its rows
        are read: no flat columns to build and cut again). Keys given the same ``rows``
        object are sharded alike, and the result says so."""
        from aoa import _core

        lists = _core.new_record_groups(cls, _FIELDS, keys, rows)
        first: dict[int, int] = {}  # id of a rows object (all alive here) -> its first key
        return ReadShardInfo.made(keys, lists,
                                  list(map(first.setdefault, map(id, rows), itertools.count())))

    @property
    def numel(self) -> int:
        return prod(self.local_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the box (dtype None reads as float32, as in Paddle)."""
        return prod(self.local_shape) * ITEMSIZES[self.dtype or "float32"]

    def to_json(self) -> dict:
        return {"key": self.key, "local_shape": list(self.local_shape),
                "global_shape": list(self.global_shape),
                "global_offset": list(self.global_offset), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Mapping) -> ShardDesc:
        if not isinstance(data, Mapping):
            raise UsageError(f"a shard description is an object with key, local_shape, "
                             f"global_shape and global_offset, not {quote(data)}")
        if not ("key" in data and "local_shape" in data and "global_shape" in data
                and "global_offset" in data):
            missing = [name for name in ("key", *_BOX_FIELDS) if name not in data]
            raise UsageError(f"shard description {quote(dict(data))} lacks "
                             + ", ".join(missing))
        return cls(data["key"], data["local_shape"], data["global_shape"],
                   data["global_offset"], data.get("dtype"))

    @classmethod
    def full(cls, key: str, shape: Sequence[int], dtype: str | None = None) -> ShardDesc:
        """An unsharded tensor: one shard covering everything."""
        return cls(key, tuple(shape), tuple(shape), (0,) * len(shape), dtype)


_INT_ONLY = frozenset({int})


_ShardFields = fields_twin(ShardDesc)
#: ShardDesc's fields in order (its slots), for the records made in bulk.
_FIELDS = tuple(vars(ShardDesc)["__slots__"])

ShardInfo = Mapping[str, Sequence[ShardDesc]]


class ReadShardInfo(dict[str, list[ShardDesc]]):
    """Shard info as a reader made it in bulk (`aoa.mapping.read_shard_info`, a source's
    ``shards``), with what the reader knew: which keys are sharded alike (the experts of a
    layer are). A compile would otherwise find that out again by building every key's tuple
    of boxes. What the reader knew is used only while the dict holds exactly the shards it
    was said of (`sharded_alike`): the same keys in order, the same ShardDesc objects in
    the same lists' order."""

    __slots__ = ("_alike", "_counts", "_keys", "_shards")

    _keys: list[str]
    _shards: list[ShardDesc]
    _counts: list[int]
    _alike: list[int]

    @classmethod
    def made(cls, keys: Sequence[str], lists: Sequence[list[ShardDesc]], alike: list[int],
             shards: list[ShardDesc] | None = None) -> ReadShardInfo:
        """{keys[i]: lists[i]}, each list a key's shards (checked, none empty, each under
        its key). ``alike[i]``: the position of the first key the reader found sharded as
        key ``i`` is (``i`` itself, if none before): keys of one position have the same
        boxes and dtypes, in order (keys of two positions may have them too). ``shards``:
        every list's shards in order, where the reader has them in one list already."""
        info = cls(zip(keys, lists))
        info._keys, info._alike = list(keys), alike
        info._shards = (list(itertools.chain.from_iterable(lists)) if shards is None
                        else shards)
        info._counts = list(map(len, lists))
        return info

    def unchanged(self) -> bool:
        """Whether the dict holds exactly what it was made with (few C-level passes)."""
        lists = list(self.values())
        return (list(self) == self._keys and _LIST_ONLY.issuperset(map(type, lists))
                and list(map(len, lists)) == self._counts
                and list(itertools.chain.from_iterable(lists)) == self._shards)

    def copied(self) -> ReadShardInfo:
        """A new dict of new lists of the same shards, knowing what this one knows."""
        info = ReadShardInfo(zip(self._keys, map(list.copy, self.values())))
        info._keys, info._shards = self._keys, self._shards
        info._counts, info._alike = self._counts, self._alike
        return info


def sharded_alike(info: ShardInfo | None
                  ) -> tuple[list[str], list[int], list[list[ShardDesc]]] | None:
    """What a reader knew of ``info`` (a `ReadShardInfo` still as made): its keys, each
    key's way of being sharded, numbered from 0 in the order first met (keys with equal
    numbers have equal boxes and dtypes, in order), and the shards of each way's first
    key. None where ``info`` is anything else."""
    if type(info) is not ReadShardInfo or not info.unchanged():
        return None
    firsts = list(dict.fromkeys(info._alike))  # in the order first met
    number = dict(zip(firsts, itertools.count()))
    lists = list(info.values())
    return (info._keys, list(map(number.__getitem__, info._alike)),
            list(map(lists.__getitem__, firsts)))


def shard_kinds(shards: Sequence[ShardDesc]
                ) -> tuple[list[int], dict[int, tuple[str | None, tuple[int, ...]]]]:
    """Each shard's kind, a number naming its (dtype, local shape), and the pair of each
    number: what depends only on these is worked out once per kind, and a list of 100k
    shards of a few dozen shapes costs a few C-level passes, no Python call per shard."""
    dtypes = set(map(_DTYPE, shards))
    keys: list = (list(map(_LOCAL_SHAPE, shards)) if len(dtypes) == 1  # no pair per shard
                  else list(zip(map(_DTYPE, shards), map(_LOCAL_SHAPE, shards))))
    first: dict = {}  # key -> where it is first seen, its number
    numbers = list(map(first.setdefault, keys, itertools.count()))
    if len(dtypes) == 1:
        (dtype,) = dtypes
        return numbers, {number: (dtype, shape) for shape, number in first.items()}
    return numbers, {number: kind for kind, number in first.items()}


def shards_nbytes(shards: Sequence[ShardDesc]) -> list[int]:
    """Each shard's `ShardDesc.nbytes`: in one native pass (`aoa._core.shard_nbytes`: the
    125k shards of a 61x256 MoE's TP4 output 17 -> ~4 ms, their objects scattered in
    memory), else worked out once per `shard_kinds` kind."""
    from aoa import _core

    made = _core.shard_nbytes(shards, ITEMSIZES, "float32")
    if made is not None:
        nbytes: list[int] = made.tolist()
        return nbytes
    numbers, kinds = shard_kinds(shards)
    of_kind = {number: prod(shape) * ITEMSIZES[dtype or "float32"]
               for number, (dtype, shape) in kinds.items()}
    return list(map(of_kind.__getitem__, numbers))


_DTYPE = operator.attrgetter("dtype")
_LOCAL_SHAPE = operator.attrgetter("local_shape")


def split_optimizer_suffix(key: str) -> tuple[str, str | None]:
    """(model-state key, suffix) for the first suffix in Paddle's order that ``key`` ends with.
    Not cached: one `str.endswith` answers the usual key, and a cache of the 31k keys of a
    large model made every later engine in the process slower (bench/README.md, goal 1)."""
    if not key.endswith(OPTIMIZER_SUFFIXES):  # the usual: one test for all of them
        return key, None
    for suffix in OPTIMIZER_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], suffix
    return key, None


def model_state_keys(info: ShardInfo | None) -> frozenset[str]:
    """The keys less their optimizer suffixes; keys without one (the usual: all of a model's
    weights) found in one C-level pass and taken as they are."""
    keys = list(info or ())
    suffixed = list(itertools.compress(keys, map(str.endswith, keys,
                                                 itertools.repeat(OPTIMIZER_SUFFIXES))))
    if not suffixed:
        return frozenset(keys)
    return frozenset(keys).difference(suffixed).union(
        [split_optimizer_suffix(key)[0] for key in suffixed])


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
    if not isinstance(info, Mapping):
        raise UsageError(f"{what} shard info must map keys to lists of shards, not "
                         f"{quote(info)}")
    if type(info) is ReadShardInfo and info.unchanged():
        return info.copied()  # made by a reader from checked shards, as is
    already = _checked_already(info)
    if already is not None:
        return already
    result: dict[str, list[ShardDesc]] = {}
    shapes_known: set[tuple[tuple[int, ...], str | None]] = set()
    for key, shards in info.items():
        converted = _from_plain_json(key, shards, shapes_known)
        if converted is None:
            # `as_shard` called only for what is not a ShardDesc already (the usual)
            converted = [shard if type(shard) is ShardDesc else as_shard(shard)
                         for shard in _as_list(shards)]
        if not converted:
            raise UsageError(f"{what} shard info lists no shard of {quote(key)}")
        for shard in converted:
            if shard.key != key:
                raise UsageError(f"{what} shard listed under {quote(key)} describes "
                                 f"{quote(shard.key)}")
        result[key] = converted
    return result


def _checked_already(info: Mapping) -> dict[str, list[ShardDesc]] | None:
    """``info`` in new lists where it is what `normalize_shard_info` makes (lists of
    ShardDesc, checked when made, none empty, each shard under its own key), found in a few
    C-level passes with no Python call per shard: what `read_shard_info`, `open_source` and
    `aoa.compile`'s callers hand over. None where anything else is in it."""
    keys, lists = list(info), list(info.values())
    if not _LIST_ONLY.issuperset(map(type, lists)) or not all(lists):
        return None
    shards = list(itertools.chain.from_iterable(lists))
    if not _SHARD_DESC_ONLY.issuperset(map(type, shards)) or list(map(_KEY, shards)) != [
            key for key, listed in zip(keys, lists) for _ in listed]:
        return None
    return dict(zip(keys, map(list.copy, lists)))


_LIST_ONLY = frozenset({list})
_SHARD_DESC_ONLY = frozenset({ShardDesc})
_KEY = operator.attrgetter("key")


def _from_plain_json(key: str, shards: object,
                     shapes_known: set[tuple[tuple[int, ...], str | None]]
                     ) -> list[ShardDesc] | None:
    """The shards of ``key`` as read from shard-info JSON (a list of dicts of int lists),
    made with the checks of `ShardDesc` done in bulk: a destination of 125k shards is read
    in a fraction of the time one checked construction each takes. None where anything is
    unusual (a shard of another class or key, a number that is not an int, a box out of
    its shape, an unknown dtype): those are made one by one, whose errors say what is wrong.
    ``shapes_known``: (global shape, dtype) pairs already found sound, shared across keys."""
    if type(shards) is not list or type(key) is not str or not (key.isascii() or is_text(key)):
        return None
    made = []
    unchecked = ShardDesc.unchecked
    for data in shards:
        if type(data) is not dict or data.get("key") != key:
            return None
        local, total, offset = (data.get("local_shape"), data.get("global_shape"),
                                data.get("global_offset"))
        if not (type(local) is list and type(total) is list and type(offset) is list
                and len(local) == len(total) == len(offset)
                and _INT_ONLY.issuperset(map(type, local + total + offset))):
            return None
        for o, n, t in zip(offset, local, total):
            if o < 0 or n < 0 or o + n > t:
                return None
        dtype = data.get("dtype")
        if dtype is not None and type(dtype) is not str:
            return None
        total_box = tuple(total)
        if (total_box, dtype) not in shapes_known:
            if dtype is not None and not is_known(dtype):
                return None
            if shape_problem(total_box, itemsize(dtype or "float32")) is not None:
                return None
            shapes_known.add((total_box, dtype))
        made.append(unchecked(key, tuple(local), total_box, tuple(offset), dtype))
    return made


def _as_list(shards) -> Iterable:
    return [shards] if not isinstance(shards, (list, tuple)) else shards


def as_shard(shard) -> ShardDesc:
    """A ShardDesc from one, from Paddle's ShardedWeightDesc, or from a case.json dict."""
    if isinstance(shard, ShardDesc):
        return shard
    if isinstance(shard, Mapping):
        return ShardDesc.from_json(shard)
    missing = [name for name in ("key", *_BOX_FIELDS) if not hasattr(shard, name)]
    if missing:
        raise UsageError(f"{quote(shard)} is not a shard description: it has no "
                         + ", ".join(missing))
    return ShardDesc(shard.key, shard.local_shape, shard.global_shape, shard.global_offset,
                     getattr(shard, "dtype", None))


_BOX_FIELDS = ("local_shape", "global_shape", "global_offset")


def as_box(key: object, field_name: str, box: object) -> tuple[int, ...]:
    """``box`` as a tuple of ints (numpy integers too; not floats, strings or bools); a
    UsageError naming ``key`` and ``field_name`` otherwise."""
    if type(box) is list or type(box) is tuple:  # the usual: JSON lists of ints, at once
        values = tuple(box)
        if _INT_ONLY.issuperset(map(type, values)):
            return values
    try:
        if isinstance(box, (str, bytes)) or not isinstance(box, Iterable):
            raise TypeError
        values = tuple(box)
        if any(isinstance(n, bool) for n in values):
            raise TypeError
        return tuple(operator.index(n) for n in values)
    except TypeError:
        raise UsageError(f"shard of {quote(key)}: {field_name} {quote(box)} is not a list of "
                         "integers") from None


def _check_shard(shard: ShardDesc) -> None:
    key = shard.key
    offsets, sizes, totals = shard.global_offset, shard.local_shape, shard.global_shape
    if not isinstance(key, str) or not (key.isascii() or is_text(key)):
        raise UsageError(f"a shard's key must be a text, not {quote(key)}")
    if shard.dtype is not None and not (isinstance(shard.dtype, str) and is_known(shard.dtype)):
        raise UsageError(f"shard of '{key}' has dtype {quote(shard.dtype)}, which aoa does not "
                         f"know", hint="Known dtypes: " + ", ".join(ITEMSIZES) + ".")
    if len(offsets) == len(sizes) == len(totals) and all(
            o >= 0 and n >= 0 and o + n <= t for o, n, t in zip(offsets, sizes, totals)):
        problem = shape_problem(totals, itemsize(shard.dtype or "float32"))
        if problem is None:
            return
        raise UsageError(f"shard of '{key}': its global shape {quote(list(totals))} {problem}")
    rank = len(shard.global_shape)
    if len(shard.local_shape) != rank or len(shard.global_offset) != rank:
        raise UsageError(f"shard of '{key}' has local shape {quote(list(shard.local_shape))}, "
                         f"global shape {quote(list(shard.global_shape))} and offset "
                         f"{quote(list(shard.global_offset))} of different ranks")
    for axis, (offset, size, total) in enumerate(
            zip(shard.global_offset, shard.local_shape, shard.global_shape)):
        if offset < 0 or size < 0 or offset + size > total:
            raise UsageError(f"shard of '{key}' reaches past its global shape on axis "
                             f"{axis}: offset {offset} + size {size} > {total}")


# -- box arithmetic over shards: replicas, coverage, overlaps ------------------------------

#: Above this many boundary-grid cells (irregular boxes), compare boxes pairwise instead.
_MAX_GRID_CELLS = 1 << 22
#: Up to this many boxes, compare them pairwise in plain Python: numpy's set-up for the
#: grid costs ~200 us a key, seconds over a checkpoint of tens of thousands of keys.
_FEW_BOXES = 16


class _Box(Protocol):
    @property
    def global_offset(self) -> tuple[int, ...]: ...
    @property
    def local_shape(self) -> tuple[int, ...]: ...


def distinct_boxes(shards: Sequence[_Box]) -> list[int]:
    """Positions of the distinct boxes among ``shards``, in order: a replica (the same box
    listed again, as every rank of a data-parallel group saves it) counts once, at its
    first listing."""
    first: dict[tuple, int] = {}
    for position, shard in enumerate(shards):
        first.setdefault((shard.global_offset, shard.local_shape), position)
    return list(first.values())


def elements(shards: Iterable[_Box]) -> int:
    """Elements the boxes hold together, counted box by box (overlaps counted twice)."""
    return sum(prod(shard.local_shape) for shard in shards)


@dataclass(frozen=True)
class TilingFault:
    """How distinct boxes fail to tile a shape: two that share an element (positions
    ``overlap``), or, when none do, elements that none holds (``covered`` < ``total``)."""

    overlap: tuple[int, int] | None
    covered: int
    total: int


def tiling_fault(shape: Sequence[int], boxes: Sequence[_Box]) -> TilingFault | None:
    """None when ``boxes`` (replicas already set aside) hold every element of ``shape``
    exactly once; else what is wrong. Exact: no two boxes share an element, and together
    they hold as many elements as the shape has (so, none being outside it, all of them).
    Counting elements alone would pass two overlapping boxes that leave a gap."""
    solid = [position for position, box in enumerate(boxes) if prod(box.local_shape)]
    pair = overlapping_pair([boxes[position] for position in solid])
    total = prod(shape)
    if pair is not None:
        return TilingFault((solid[pair[0]], solid[pair[1]]), 0, total)
    covered = elements(boxes)
    return None if covered == total else TilingFault(None, covered, total)


def check_tiling(key: str, shards: Sequence[ShardDesc], what: str = "source") -> None:
    """The shards listed for ``key`` describe one tensor (one global shape and dtype), and
    its distinct boxes (a replica counts once) tile it exactly: a PlanError otherwise.

    Every list of source shards is checked here, whatever brought it (`aoa.compile`,
    shard-info JSON, the Paddle drop-in); checkpoints read from disk are checked by
    `aoa.storage.chunks` with the same arithmetic, naming their files."""
    first = shards[0]
    for shard in shards[1:]:
        if shard.global_shape != first.global_shape or shard.dtype != first.dtype:
            raise PlanError(
                f"the {what} shards of '{key}' describe different tensors: "
                f"{_described(first)} and {_described(shard)}",
                hint="Every shard of a key has the tensor's global shape and dtype.")
    distinct = [shards[position] for position in distinct_boxes(shards)]
    fault = tiling_fault(first.global_shape, distinct)
    if fault is None:
        return
    hint = "List every shard of the tensor once, with its global offset."
    if fault.overlap is not None:
        one, other = (distinct[position] for position in fault.overlap)
        raise PlanError(f"the {what} shards of '{key}' overlap: [{_region(one)}] and "
                         f"[{_region(other)}] share elements of its global shape "
                         f"{list(first.global_shape)}", hint=hint)
    raise PlanError(f"the {what} shards of '{key}' cover {fault.covered} of the "
                     f"{fault.total} elements of its global shape "
                     f"{list(first.global_shape)}", hint=hint)


def _region(shard: ShardDesc) -> str:
    return ", ".join(f"{o}:{o + n}" for o, n in zip(shard.global_offset, shard.local_shape))


def _described(shard: ShardDesc) -> str:
    return f"[{_region(shard)}] of {list(shard.global_shape)} {shard.dtype or '(no dtype)'}"


def overlapping_pair(shards: Sequence[_Box]) -> tuple[int, int] | None:
    """Positions of two boxes that share an element, if any."""
    if len(shards) < 2:
        return None
    if len(shards) <= _FEW_BOXES:
        return _overlapping_few(shards)
    import numpy as np  # only where many shards are compared: most compiles need no numpy

    ndim = len(shards[0].global_offset)
    starts = np.array([s.global_offset for s in shards], np.int64).reshape(len(shards), ndim)
    ends = starts + np.array([s.local_shape for s in shards], np.int64).reshape(starts.shape)
    return _overlapping_boxes(starts, ends)


def _overlapping_few(shards: Sequence[_Box]) -> tuple[int, int] | None:
    """The first pair (in listing order) of boxes that share an element: two boxes do when
    their extents meet on every axis."""
    boxes = [(s.global_offset, s.local_shape) for s in shards]
    for i, (start, shape) in enumerate(boxes):
        for j in range(i + 1, len(boxes)):
            other, other_shape = boxes[j]
            if all(max(a, b) < min(a + n, b + m)
                   for a, n, b, m in zip(start, shape, other, other_shape)):
                return i, j
    return None


def _overlapping_boxes(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    """Two boxes [start, end) that share an element, if any.

    Counted on the grid of all box boundaries: a cell between consecutive boundaries is
    wholly inside a box or wholly outside, so a cell inside two boxes is an overlap. The
    counts come from a difference array (+1/-1 at each box's corners, then a cumulative sum
    per axis), in time linear in boxes and cells; irregular boxes fall back to pairs.
    """
    import numpy as np

    count, ndim = starts.shape
    if count < 2:
        return None
    if ndim == 0:
        return (0, 1)
    bounds = [np.unique(np.concatenate([starts[:, a], ends[:, a]])) for a in range(ndim)]
    if math.prod(len(b) - 1 for b in bounds) > _MAX_GRID_CELLS:
        return _overlapping_boxes_pairwise(starts, ends)
    low = [np.searchsorted(bounds[a], starts[:, a]) for a in range(ndim)]
    high = [np.searchsorted(bounds[a], ends[:, a]) for a in range(ndim)]
    cells = np.zeros([len(b) for b in bounds], np.int32)
    for corner in itertools.product((False, True), repeat=ndim):
        index = tuple(high[a] if up else low[a] for a, up in enumerate(corner))
        np.add.at(cells, index, -1 if sum(corner) % 2 else 1)
    for axis in range(ndim):
        cells = np.cumsum(cells, axis=axis)
    crowded = np.argwhere(cells > 1)
    if not len(crowded):
        return None
    point = np.array([bounds[a][crowded[0][a]] for a in range(ndim)])
    inside = np.flatnonzero(((starts <= point) & (point < ends)).all(axis=1))
    return int(inside[0]), int(inside[1])


def _overlapping_boxes_pairwise(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    """The same answer by comparing each box with every later one, a block at a time."""
    import numpy as np

    for first in range(0, len(starts), 256):
        block = slice(first, first + 256)
        inner = np.minimum(ends[block, None], ends[None]) > np.maximum(
            starts[block, None], starts[None]
        )
        shared = inner.all(axis=2) & (
            np.arange(len(starts))[None] > np.arange(first, first + len(inner))[:, None]
        )
        if shared.any():
            i, j = np.argwhere(shared)[0]
            return first + int(i), int(j)
    return None
