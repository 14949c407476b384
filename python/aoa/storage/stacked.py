"""Stacked keys: one stored tensor for a key of every layer (or expert), a leading axis per
index, as Megatron-Core's distributed checkpoint keeps a model.

A model names one tensor per layer and expert (``decoder.layers.3.self_attention.linear_qkv
.weight``, ``decoder.layers.3.mlp.experts.linear_fc1.weight5``); Megatron's ``torch_dist``
checkpoint stores all layers of a key as one tensor with a leading layer axis
(``decoder.layers.self_attention.linear_qkv.weight``: [layers, ...]) and all experts of a
layer with a further expert axis. The bytes are the same: layer 3's tensor is the box at
(3, 0, ...) of shape (1, ...) of the stacked one, so translating between the two moves no
byte. A `Stacking` rule says which keys stack into which, `stack_shards` translates the
shards a destination writes, and `UnstackedSource` shows a stacked checkpoint with one key
per index (each index's box a slice of the stored chunk's bytes).

A rule's templates use the language's placeholders: ``$LAYER_ID`` and ``$EXPERT_ID`` in
``each`` that are absent from ``stacked`` become leading axes, in the order they appear in
``each`` (their counts in ``sizes``); one that is in both is carried as it is (Megatron keeps
per-layer keys where layers differ, stacking only experts); one ``*`` in both stands for
the same rest of the key. The first rule that matches a key decides; a key no rule matches
is stored as it is.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from aoa.dtypes import itemsize
from aoa.errors import StorageError
from aoa.layout import ShardDesc
from aoa.storage.formats import Source

PLACEHOLDERS = ("$LAYER_ID", "$EXPERT_ID")
_PART = re.compile(r"(\$LAYER_ID|\$EXPERT_ID|\*)")


@dataclass(frozen=True)
class Stacking:
    """Keys matching ``each`` stored as ``stacked``, with a leading axis of ``sizes[i]`` for
    the i-th placeholder of ``each`` that ``stacked`` lacks."""

    each: str
    stacked: str
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        each, stacked = _parts(self.each), _parts(self.stacked)
        if each.count("*") > 1 or each.count("*") != stacked.count("*"):
            raise ValueError(f"stacking '{self.each}' -> '{self.stacked}': one '*' in both "
                             "or in neither")
        if not set(stacked) <= set(each):
            raise ValueError(f"stacking '{self.each}' -> '{self.stacked}': the stacked key "
                             "has a placeholder the key lacks")
        if len(self.stacked_axes) != len(self.sizes):
            raise ValueError(f"stacking '{self.each}' -> '{self.stacked}': "
                             f"{len(self.stacked_axes)} stacked axes, {len(self.sizes)} sizes")

    @cached_property
    def stacked_axes(self) -> tuple[str, ...]:
        """The placeholders of ``each`` that become leading axes, in order."""
        carried = set(_parts(self.stacked))
        return tuple(p for p in _parts(self.each) if p in PLACEHOLDERS and p not in carried)

    @cached_property
    def _each(self) -> re.Pattern[str]:
        return _pattern(self.each)

    @cached_property
    def _stacked(self) -> re.Pattern[str]:
        return _pattern(self.stacked)

    def stack(self, key: str) -> tuple[str, tuple[int, ...]] | None:
        """The stacked key of ``key`` and its indices on the leading axes, or None."""
        found = self._each.match(key)
        if found is None:
            return None
        values = dict(zip(_parts(self.each), found.groups()))
        indices = tuple(int(values[p]) for p in self.stacked_axes)
        for index, size, placeholder in zip(indices, self.sizes, self.stacked_axes):
            if index >= size:
                raise StorageError(f"'{key}': {placeholder} {index} is past the {size} the "
                                   f"stacked key '{self.stacked}' holds")
        return _fill(self.stacked, values), indices

    def holds(self, stacked: str) -> bool:
        """Whether ``stacked`` is a stacked key of this rule."""
        return self._stacked.match(stacked) is not None

    def unstack(self, stacked: str, indices: tuple[int, ...]) -> str | None:
        """The key of ``indices`` in the stacked key ``stacked``, or None if it is not one."""
        found = self._stacked.match(stacked)
        if found is None:
            return None
        values = dict(zip(_parts(self.stacked), found.groups()))
        values.update((p, str(i)) for p, i in zip(self.stacked_axes, indices))
        return _fill(self.each, values)

    def to_json(self) -> list:
        return [self.each, self.stacked, list(self.sizes)]

    @classmethod
    def from_json(cls, data: Sequence) -> Stacking:
        each, stacked, sizes = data
        return cls(str(each), str(stacked), tuple(int(size) for size in sizes))


def _parts(template: str) -> list[str]:
    """The placeholders and ``*`` of a template, in order."""
    return _PART.findall(template)


def _pattern(template: str) -> re.Pattern[str]:
    pieces = _PART.split(template)
    out = []
    for piece in pieces:
        if piece in PLACEHOLDERS:
            out.append(r"(\d+)")
        elif piece == "*":
            out.append(r"(.+)")
        else:
            out.append(re.escape(piece))
    return re.compile("".join(out) + r"\Z")


def _fill(template: str, values: Mapping[str, str]) -> str:
    return "".join(values.get(piece, piece) for piece in _PART.split(template))


def stacked_shard(shard: ShardDesc, rules: Sequence[Stacking]) -> ShardDesc:
    """``shard`` as stored under its stacked key (itself if no rule matches)."""
    for rule in rules:
        found = rule.stack(shard.key)
        if found is not None:
            key, indices = found
            ones = (1,) * len(indices)
            return ShardDesc(key, ones + shard.local_shape, rule.sizes + shard.global_shape,
                             indices + shard.global_offset, shard.dtype)
    return shard


def stack_shards(shards: Sequence[ShardDesc], rules: Sequence[Stacking]) -> list[ShardDesc]:
    """The destination shards as a stacked checkpoint stores them, in the same order (each
    one's bytes are the same). Keys of one stacked key must agree on shape and dtype."""
    stored = [stacked_shard(shard, rules) for shard in shards]
    first: dict[str, tuple[ShardDesc, ShardDesc]] = {}
    for shard, original in zip(stored, shards):
        other, other_original = first.setdefault(shard.key, (shard, original))
        if (other.global_shape, other.dtype) != (shard.global_shape, shard.dtype):
            raise StorageError(
                f"'{original.key}' ({original.dtype} {list(original.global_shape)}) and "
                f"'{other_original.key}' ({other_original.dtype} "
                f"{list(other_original.global_shape)}) differ, so they cannot be stacked "
                f"into '{shard.key}'")
    return stored


@dataclass(frozen=True)
class _Slice:
    """An unstacked shard's bytes: ``nbytes`` from ``start`` of a stored shard's."""

    stored: ShardDesc
    start: int
    nbytes: int


class UnstackedSource(Source[_Slice]):
    """A source whose stacked keys show as one key per index (everything else as it is)."""

    def __init__(self, inner: Source, rules: Sequence[Stacking]) -> None:
        self.inner = inner
        self.rules = tuple(rules)
        found: dict[str, list[tuple[ShardDesc, _Slice]]] = {}
        for key, shards in inner.shards.items():
            rule = next((r for r in self.rules if r.holds(key)), None)
            for shard in shards:
                if rule is None:
                    found.setdefault(key, []).append((shard, _Slice(shard, 0, shard.nbytes)))
                    continue
                for piece in _pieces(shard, rule, inner.path):
                    found.setdefault(piece[0].key, []).append(piece)
        for pieces in found.values():
            pieces.sort(key=lambda piece: piece[0].global_offset)
        super().__init__(inner.path, inner.format, found)

    def buffer(self, shard: ShardDesc) -> memoryview:
        where = self.location(shard)
        view = memoryview(self.inner.buffer(where.stored))
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        return view[where.start:where.start + where.nbytes]

    def release(self, shard: ShardDesc) -> None:
        self.inner.release(self.location(shard).stored)

    def file_of(self, shard: ShardDesc) -> Path:
        return self.inner.file_of(self.location(shard).stored)

    def files(self) -> list[Path]:
        return self.inner.files()

    def extras(self) -> dict[str, Path]:
        return self.inner.extras()

    def objects(self) -> dict[str, bytes]:
        return self.inner.objects()

    def close(self) -> None:
        self.inner.close()


def _pieces(shard: ShardDesc, rule: Stacking, where: Path
            ) -> list[tuple[ShardDesc, _Slice]]:
    """The per-index shards inside a stored shard of a stacked key, with their bytes."""
    count = len(rule.sizes)
    if shard.global_shape[:count] != rule.sizes:
        raise StorageError(f"{where}: '{shard.key}' holds "
                           f"{list(shard.global_shape[:count])} on its stacked axes, not the "
                           f"{list(rule.sizes)} its stacking says",
                           hint="The checkpoint was written for another model config "
                                "(layer or expert counts).")
    inner_local = shard.local_shape[count:]
    nbytes = math.prod(inner_local) * itemsize(shard.dtype or "float32")
    pieces = []
    ranges = [range(o, o + n) for o, n in zip(shard.global_offset[:count],
                                              shard.local_shape[:count])]
    for position, indices in enumerate(itertools.product(*ranges)):  # C order
        key = rule.unstack(shard.key, indices)
        assert key is not None
        piece = ShardDesc(key, inner_local, shard.global_shape[count:],
                          shard.global_offset[count:], shard.dtype)
        pieces.append((piece, _Slice(shard, position * nbytes, nbytes)))
    return pieces
