"""Random AOA programs with their meaning worked out in numpy, independently of aoa.

A program is built from blocks (a rename chain, a split, a concat over `*`, a fused merge,
a fused split, two fused statements in a row, a fused tensor reaching its keys through a
split or coming from a concat, names that a careless macro would capture, ...). Each
statement comes with an `Op`: what it does to numpy arrays (the spec's plain operations:
split, concat, transpose, cast, alias, and the fused layouts of spec 5.8-5.10 written out
here) and, for reverse runs, what undoes it. The fused layouts use the shard count of the
stored tensor the fused tensor flows from or to (README, Decisions); a tensor between two
fused statements is laid out as one shard.

`programs()` is the hypothesis strategy of `Program`s; `expected(program, arrays)` runs the
ops forward (or undoes them backwards, for a reverse run) over the arrays it reads. A
forward merge over one shard is the parts' plain concat, whatever their sizes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "float64": np.dtype(np.float64), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
COUNTS = (1, 2, 3, 4, 5, 6, 7, 8)  # shard counts (tensor parallelism 1-8)

Arrays = list[np.ndarray]


# -- the fused layouts, per the spec's definitions -------------------------------------------

def ffn_fuse(gate: np.ndarray, up: np.ndarray, shards: int, axis: int) -> np.ndarray:
    """Per shard r: [gate_r | up_r] (spec 5.9)."""
    gates, ups = np.split(gate, shards, axis), np.split(up, shards, axis)
    return np.concatenate([x for r in range(shards) for x in (gates[r], ups[r])], axis)


def ffn_unfuse(fused: np.ndarray, shards: int, axis: int) -> Arrays:
    halves = [np.split(rank, 2, axis) for rank in np.split(fused, shards, axis)]
    return [np.concatenate([h[0] for h in halves], axis),
            np.concatenate([h[1] for h in halves], axis)]


def qkv_old_fuse(q, k, v, heads: int, groups: int, shards: int, axis: int) -> np.ndarray:
    """Per shard r: [its query heads | its key heads | its value heads] (spec 5.8)."""
    qs, ks, vs = (np.split(x, shards, axis) for x in (q, k, v))
    return np.concatenate([x for r in range(shards) for x in (qs[r], ks[r], vs[r])], axis)


def qkv_old_unfuse(fused, heads: int, groups: int, shards: int, axis: int) -> Arrays:
    head = fused.shape[axis] // (heads + 2 * groups)
    q_rank, kv_rank = heads // shards * head, groups // shards * head
    parts: list[Arrays] = [[], [], []]
    for rank in np.split(fused, shards, axis):
        pieces = np.split(rank, [q_rank, q_rank + kv_rank], axis)
        for part, piece in zip(parts, pieces):
            part.append(piece)
    return [np.concatenate(part, axis) for part in parts]


def qkv_fuse(q, k, v, heads: int, groups: int, axis: int) -> np.ndarray:
    """Per group g: its query heads, then key head g, then value head g (spec 5.10)."""
    qh, kh, vh = np.split(q, heads, axis), np.split(k, groups, axis), np.split(v, groups, axis)
    per = heads // groups
    return np.concatenate([x for g in range(groups)
                           for x in (*qh[g * per:(g + 1) * per], kh[g], vh[g])], axis)


def qkv_unfuse(fused, heads: int, groups: int, axis: int) -> Arrays:
    per = heads // groups
    pieces = np.split(fused, heads + 2 * groups, axis)
    q, k, v = [], [], []
    for g in range(groups):
        block = pieces[g * (per + 2):(g + 1) * (per + 2)]
        q += block[:per]
        k.append(block[per])
        v.append(block[per + 1])
    return [np.concatenate(x, axis) for x in (q, k, v)]


# -- programs ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Op:
    """One statement's meaning: arrays of ``writes`` from arrays of ``reads``; ``undo`` gives
    the reads back from the writes (what the statement means in a reverse run)."""

    reads: tuple[str, ...]
    writes: tuple[str, ...]
    do: Callable[[Arrays], Arrays]
    undo: Callable[[Arrays], Arrays]


@dataclass(frozen=True)
class Stored:
    """A key of a checkpoint: its shape, dtype and equal shards along one axis."""

    shape: tuple[int, ...]
    dtype: str
    shards: int = 1
    axis: int = 0


@dataclass
class Program:
    statements: list[str] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    sources: dict[str, Stored] = field(default_factory=dict)
    destinations: dict[str, Stored] = field(default_factory=dict)
    #: keys that carry a `.moment1_0` optimizer state in both checkpoints
    states: set[str] = field(default_factory=set)
    reverse: bool = False
    #: run without destination shard information (outputs derived, as a full export)
    derive: bool = False


def permuted(x: np.ndarray, perm: Sequence[int]) -> np.ndarray:
    return np.transpose(x, perm)


def inverse_permutation(perm: Sequence[int]) -> list[int]:
    return [int(i) for i in np.argsort(perm)]


def expected(program: Program, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every key the run writes, from the arrays of the keys it reads: the ops in order, or
    undone in reverse order for a reverse run (whose reads are the forward run's writes)."""
    env = dict(arrays)
    if program.reverse:
        for op in reversed(program.ops):
            env.update(zip(op.reads, op.undo([env[name] for name in op.writes])))
        wanted = program.sources
    else:
        for op in program.ops:
            env.update(zip(op.writes, op.do([env[name] for name in op.reads])))
        wanted = program.destinations
    return {key: env[key] for key in wanted}


class Builder:
    """Draws the blocks of one program; names of block i start with `b{i}.`."""

    def __init__(self, draw, reverse: bool, derive: bool) -> None:
        self.draw = draw
        self.program = Program(reverse=reverse, derive=derive)
        self.block = 0
        self.fresh = 0
        #: (statement, its ops) of the block being drawn, and of the blocks drawn
        self.items: list[tuple[str, list[Op]]] = []
        self.blocks: list[list[tuple[str, list[Op]]]] = []
        #: the keys the block being drawn declares
        self.keys: list[str] = []
        #: the ids of the template being drawn, per placeholder its names hold
        #: ($LAYER_ID, maybe $EXPERT_ID)
        self.layers: dict[str, list[int]] | None = None
        #: names read through `^T`, and q/k/v of fused_qkv: a careless macro names pieces
        #: after them (`w_transpose_tmp`, `q0`)
        self.lookalikes: list[str] = []

    # names and keys
    def name(self, what: str = "t") -> str:
        self.fresh += 1
        ids = "".join(f".{p[1].lower()}{p}" for p in self.layers or ())
        return f"b{self.block}{ids}.{what}{self.fresh}"

    def count(self, other: int = 1) -> int:
        """A shard count whose least common multiple with ``other`` stays small (a fused
        tensor is cut into that many pieces a half or head group)."""
        return self.draw(st.sampled_from([c for c in COUNTS if lcm(c, other) <= 24]))

    def source(self, key: str, shape: tuple[int, ...], dtype: str = "float32",
               shards: int | None = None) -> None:
        """A source key; ``shards`` fixes the count (a fused layout depends on it)."""
        self.program.sources[key] = self._stored(shape, dtype, shards, forward_source=True)
        self.keys.append(key)

    def destination(self, key: str, shape: tuple[int, ...], dtype: str,
                    shards: int | None = None) -> None:
        self.program.destinations[key] = self._stored(shape, dtype, shards,
                                                      forward_source=False)
        self.keys.append(key)

    def _stored(self, shape, dtype, shards, *, forward_source: bool) -> Stored:
        # without shard information the side a reverse run writes has one shard a key
        derived = self.program.derive and (forward_source == self.program.reverse)
        if derived:
            assert shards in (None, 1)
            return Stored(tuple(shape), dtype)
        if shards is None:
            shards = self.draw(st.sampled_from(
                [c for c in COUNTS if any(n % c == 0 for n in shape)] or [1]))
        axes = [a for a, n in enumerate(shape) if n % shards == 0]
        return Stored(tuple(shape), dtype, shards, self.draw(st.sampled_from(axes)))

    def writes_count(self) -> int | None:
        """The count a fused tensor written towards the destination must use: 1 when the
        run derives its outputs (no destination shards), else free (None)."""
        return 1 if self.program.derive and not self.program.reverse else None

    def reads_count(self) -> int | None:
        """Likewise for a fused tensor read from the forward source side."""
        return 1 if self.program.derive and self.program.reverse else None

    def emit(self, statement: str, op: Op) -> None:
        self.items.append((statement, [op]))

    def end_block(self) -> None:
        """The block's keys get optimizer states now and then (they follow the parameter
        through every statement, spec 6.8); a template's items and keys are filled in."""
        if not self.program.derive and self.draw(st.integers(0, 3)) == 0:
            self.program.states.update(self.keys)
        if self.layers is not None:
            self._instantiate(self.layers)
        self.blocks.append(self.items)
        self.items, self.layers, self.keys = [], None, []
        self.block += 1

    def _instantiate(self, ids: dict[str, list[int]]) -> None:
        """A template block: one statement each, ops and keys once per combination of
        ids (every combination exists: the id macro takes the product, spec 5.3)."""
        combinations = [dict(zip(ids, values)) for values in itertools.product(*ids.values())]

        def fill(name: str, values: dict[str, int]) -> str:
            for placeholder, value in values.items():
                name = name.replace(placeholder, str(value))
            return name

        self.items = [(text, [Op(tuple(fill(n, c) for n in op.reads),
                                 tuple(fill(n, c) for n in op.writes), op.do, op.undo)
                              for c in combinations for op in ops])
                      for text, ops in self.items]
        for stored in (self.program.sources, self.program.destinations):
            for key in [k for k in stored if "$" in k]:
                value = stored.pop(key)
                stored.update({fill(key, c): value for c in combinations})
        for key in [k for k in self.program.states if "$" in k]:
            self.program.states.discard(key)
            self.program.states.update(fill(key, c) for c in combinations)

    # plain steps ----------------------------------------------------------------------
    def step(self, name: str, shape: tuple[int, ...], dtype: str, *, casts: bool = True,
             reshape: bool = True, out: str | None = None) -> tuple[str, tuple[int, ...], str]:
        """One plain statement on ``name``: rename, transpose, permute, cast, alias or a
        regroup (split, then concat of the pieces in another order); into ``out`` if given."""
        kinds = ["rename"]
        if not (out and self.layers is not None and self.program.reverse):
            kinds.append("regroup")  # two statements: not in a reverse template
        # a run without destination shards names an alias's output after the aliased
        # tensor (spec 6.6, Q5): not as the last step, nor in a reverse run
        if not (self.program.derive and (self.program.reverse or out)):
            kinds.append("alias")
        if reshape:
            kinds.append("transpose")
            if len(shape) > 1:
                kinds.append("permute")
        if casts:
            kinds.append("cast")
        kind = self.draw(st.sampled_from(kinds))
        out = out or self.name()
        identity = Op((name,), (out,), lambda a: a, lambda a: a)
        if kind == "rename":
            self.emit(f"{name} -> {out}", identity)
        elif kind == "alias":
            axis = self.draw(st.integers(0, 4))  # an alias never uses its axis
            self.emit(f"{name} -> {out}, axis={axis}", identity)
        elif kind in ("transpose", "permute"):
            if kind == "transpose":
                perm = list(range(len(shape)))[::-1]
                text = f"{name}^T -> {out}"
                self.lookalikes.append(name + "_transpose_tmp")
            else:
                perm = list(self.draw(st.permutations(range(len(shape)))))
                text = f"{name} -> {out}, permute='{perm}'"
            back = inverse_permutation(perm)
            self.emit(text, Op((name,), (out,), lambda a, p=perm: [permuted(a[0], p)],
                               lambda a, p=back: [permuted(a[0], p)]))
            shape = tuple(shape[p] for p in perm)
        elif kind == "cast":
            target = self.draw(st.sampled_from(sorted(set(DTYPES) - {dtype})))
            text = (f"{name} -> {out}, src_dtype='{dtype}', dst_dtype='{target}'"
                    if self.program.reverse or self.draw(st.booleans())
                    else f"{name} -> {out}, dtype='{target}'")
            self.emit(text, Op((name,), (out,),
                               lambda a, d=target: [a[0].astype(DTYPES[d])],
                               lambda a, d=dtype: [a[0].astype(DTYPES[d])]))
            dtype = target
        else:
            axis = self.draw(st.integers(0, len(shape) - 1))
            parts = self.draw(st.sampled_from(divisors(shape[axis])))
            order = list(self.draw(st.permutations(range(parts))))
            if parts == 1:
                self.emit(f"{name} -> {out}", identity)
            else:
                pieces = [self.name("p") for _ in range(parts)]
                self.split(name, pieces, axis)
                self.concat([pieces[j] for j in order], out, axis)
        return out, shape, dtype

    def chain(self, name: str, shape, dtype, *, casts: bool = True, reshape: bool = True,
              most: int = 3):
        if self.layers is not None and self.program.reverse:
            most = 0  # a reverse template over temporaries expands to nothing (README)
        for _ in range(self.draw(st.integers(0, most))):
            name, shape, dtype = self.step(name, shape, dtype, casts=casts, reshape=reshape)
        return name, shape, dtype

    def split(self, name: str, pieces: Sequence[str], axis: int, text: str | None = None):
        n = len(pieces)
        self.emit(text or f"{name} -> {', '.join(pieces)}, axis={axis}",
                  Op((name,), tuple(pieces), lambda a: np.split(a[0], n, axis),
                     lambda a: [np.concatenate(a, axis)]))

    def concat(self, parts: Sequence[str], out: str, axis: int, text: str | None = None):
        n = len(parts)
        self.emit(text or f"{', '.join(parts)} -> {out}, axis={axis}",
                  Op(tuple(parts), (out,), lambda a: [np.concatenate(a, axis)],
                     lambda a: np.split(a[0], n, axis)))

    def to_destination(self, name: str, shape, dtype, shards: int | None = None, *,
                       casts: bool = True) -> str:
        """Carry the temporary ``name`` through a chain into a new destination key."""
        name, shape, dtype = self.chain(name, shape, dtype, casts=casts)
        key = self.name("d")
        self.emit(f"{name} -> {key}", Op((name,), (key,), lambda a: a, lambda a: a))
        self.destination(key, shape, dtype, shards)
        return key

    def out(self) -> tuple[str, bool]:
        """Where a block's statement writes: straight into a destination key (True; the
        caller declares it with `finish`) or into a temporary that `finish` carries on."""
        direct = (self.layers is not None and self.program.reverse) or self.draw(st.booleans())
        return (self.name("d"), True) if direct else (self.name(), False)

    def finish(self, out: tuple[str, bool], shape, dtype: str = "float32",
               shards: int | None = None, *, piece: bool = False) -> None:
        """Declare ``out`` a destination, or carry it into one. A ``piece`` of a split is
        not cast in a reverse run: there the pieces are joined, and a concat takes one
        recorded dtype (a cast does not change it, spec 6.2)."""
        name, direct = out
        if direct:
            self.destination(name, shape, dtype, shards)
        else:
            casts = not (piece and self.program.reverse)
            self.to_destination(name, shape, dtype, shards, casts=casts)

    def read(self, shape: tuple[int, ...], shards: int | None = None) -> str:
        """A new source key of ``shape`` (maybe stored transposed and read as `key^T`),
        carried through a chain that keeps its shape; returns the name to read."""
        key = self.name("s")
        if len(shape) == 2 and self.draw(st.booleans()):
            self.source(key, shape[::-1], shards=shards)
            in_reverse_template = self.layers is not None and self.program.reverse
            if in_reverse_template or self.draw(st.booleans()):
                self.lookalikes.append(key + "_transpose_tmp")
                return key + "^T"
            view = self.name()
            self.emit(f"{key}^T -> {view}", Op((key,), (view,), lambda a: [a[0].T],
                                               lambda a: [a[0].T]))
            key = view
        else:
            self.source(key, shape, shards=shards)
        key, _, _ = self.chain(key, shape, "float32", casts=False, reshape=False)
        return key


def operand(name: str) -> tuple[str, Callable[[np.ndarray], np.ndarray]]:
    """The key a name reads and how it is seen: `w^T` is `w` transposed (all axes)."""
    if name.endswith("^T"):
        return name[:-2], lambda a: np.transpose(a)
    return name, lambda a: a


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


lcm = math.lcm


def axis_attribute(draw, axis: int) -> str:
    """`, axis=N`, left out (sometimes) where it is the fused macros' default of 1."""
    return "" if axis == 1 and draw(st.booleans()) else f", axis={axis}"


class Blocks(Builder):
    """The kinds of block a program is made of."""

    def fewest(self) -> int:
        """Fewest pieces of a `*` or `[a:b]` split or concat: one name on each side with
        axis= is an alias, which a run that derives its outputs names after the aliased
        tensor (spec 6.6, Q5)."""
        return 2 if self.program.derive else 1

    def fused_shape(self, axis: int, size: int, other: int) -> tuple[int, int]:
        return (size, other) if axis == 0 else (other, size)

    # plain ---------------------------------------------------------------------------------
    def plain(self) -> None:
        rank = self.draw(st.integers(1, 3))
        shape = tuple(self.draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=rank,
                                         max_size=rank)))
        key = self.name("s")
        self.source(key, shape)
        name, shape, dtype = self.chain(key, shape, "float32", most=3)
        destination = self.name("d")
        _, shape, dtype = self.step(name, shape, dtype, out=destination)
        self.destination(destination, shape, dtype)

    def identity(self) -> None:
        """A destination key that is also a source key and that no statement writes."""
        shape = (self.draw(st.sampled_from([2, 4, 6])), self.draw(st.sampled_from([1, 2, 4])))
        key = self.name("k")
        self.source(key, shape)
        self.destination(key, shape, "float32")
        self.items.append(("", [Op((key,), (key,), lambda a: a, lambda a: a)]))

    def tied(self) -> None:
        """One source read twice (forward runs only)."""
        key, shape = self.name("s"), (2, self.draw(st.sampled_from([1, 2, 3])))
        self.source(key, shape)
        for _ in range(2):
            self.finish((key, False), shape)

    def drop(self) -> None:
        """`key -> _` (forward runs only)."""
        key = self.name("s")
        self.source(key, (2, 2))
        self.items.append((f"{key} -> _", []))

    def layer_offset(self) -> None:
        """`x.$LAYER_ID_OFFSET.w -> y.$LAYER_ID_OFFSET.w`: layer n of the source is layer
        n-1 of the destination (a reverse run maps it back, spec 5.2)."""
        layers = sorted(self.draw(st.sets(st.integers(1, 11), min_size=1, max_size=3)))
        shape = (self.draw(st.sampled_from([1, 2])), self.draw(st.sampled_from([2, 3])))
        source, target = self.name("x"), self.name("y")
        transpose = self.draw(st.booleans())
        see = np.transpose if transpose else (lambda a: a)
        for n in layers:
            self.source(f"{source}.{n}.w", shape)
            self.destination(f"{target}.{n - 1}.w", shape[::-1] if transpose else shape,
                             "float32")
        self.items.append((f"{source}.$LAYER_ID_OFFSET.w{'^T' if transpose else ''} -> "
                           f"{target}.$LAYER_ID_OFFSET.w",
                           [Op((f"{source}.{n}.w",), (f"{target}.{n - 1}.w",),
                               lambda a: [see(a[0])], lambda a: [see(a[0])])
                            for n in layers]))

    def star_concat(self) -> None:
        ids = sorted(self.draw(st.sets(st.integers(0, 12), min_size=self.fewest(),
                                       max_size=4)))
        axis = self.draw(st.integers(0, 1))
        shape = (self.draw(st.sampled_from([1, 2])), self.draw(st.sampled_from([1, 3])))
        stem = self.name("e")
        keys = [f"{stem}.{i}.w" for i in ids]
        for key in keys:
            self.source(key, shape)
        out = self.out()
        self.concat(keys, out[0], axis, f"{stem}.*.w -> {out[0]}, axis={axis}")
        joined = list(shape)
        joined[axis] *= len(keys)
        self.finish(out, tuple(joined))

    def star_split(self) -> None:
        """`key -> x.*.w`: the pieces are destination keys, in numeric order."""
        ids = sorted(self.draw(st.sets(st.integers(0, 12), min_size=self.fewest(),
                                       max_size=4)))
        shape = (2 * len(ids), self.draw(st.sampled_from([1, 2])))
        key, stem = self.name("s"), self.name("o")
        self.source(key, shape)
        pieces = [f"{stem}.{i}.w" for i in ids]
        self.split(key, pieces, 0, f"{key} -> {stem}.*.w, axis=0")
        for piece in pieces:
            self.destination(piece, (2, shape[1]), "float32")

    def array_split(self) -> None:
        parts = self.draw(st.integers(self.fewest(), 4))
        start = self.draw(st.integers(0, 3))
        axis = self.draw(st.integers(0, 1))
        shape = self.fused_shape(axis, 2 * parts, self.draw(st.sampled_from([1, 3])))
        key, stem = self.name("s"), self.name("p")
        self.source(key, shape)
        pieces = [f"{stem}_{i}" for i in range(start, start + parts)]
        self.split(key, pieces, axis, f"{key} -> {stem}[{start}:{start + parts}], axis={axis}")
        piece_shape = self.fused_shape(axis, 2, shape[1 - axis])
        if parts > 1 and self.draw(st.booleans()):
            order = list(self.draw(st.permutations(pieces)))
            out = self.out()
            self.concat(order, out[0], axis)
            self.finish(out, shape)
            return
        for piece in pieces:
            self.finish((piece, False), piece_shape, piece=True)

    def part(self, shape: tuple[int, ...], shards: int | None = None):
        """A tensor a fused statement reads: (text as written, name read, how it is seen)."""
        text = self.read(shape, shards)
        name, see = operand(text)
        return text, name, see

    # fused_ffn -----------------------------------------------------------------------------
    def ffn_merge(self) -> None:
        axis = self.draw(st.sampled_from([0, 1]))
        shards = self.writes_count() or self.count()
        half, other = shards * self.draw(st.integers(1, 2)), self.draw(st.integers(1, 3))
        # a forward merge over one shard is the halves' plain concat, of any sizes
        up_half = (self.draw(st.integers(1, 3)) if shards == 1 and not self.program.reverse
                   else half)
        (gate, g, see_g) = self.part(self.fused_shape(axis, half, other))
        (up, u, see_u) = self.part(self.fused_shape(axis, up_half, other))
        out = self.out()
        self.emit(f"{gate}, {up} -> {out[0]}, fused_ffn{axis_attribute(self.draw, axis)}",
                  Op((g, u), (out[0],),
                     lambda a: [ffn_fuse(see_g(a[0]), see_u(a[1]), shards, axis)],
                     lambda a: [f(x) for f, x in zip((see_g, see_u),
                                                     ffn_unfuse(a[0], shards, axis))]))
        self.finish(out, self.fused_shape(axis, half + up_half, other), shards=shards)

    def ffn_split(self) -> None:
        axis = self.draw(st.sampled_from([0, 1]))
        shards = self.reads_count() or self.count()
        half, other = shards * self.draw(st.integers(1, 2)), self.draw(st.integers(1, 3))
        fused, f, see = self.part(self.fused_shape(axis, 2 * half, other), shards)
        gate, up = self.out(), self.out()
        self.emit(f"{fused} -> {gate[0]}, {up[0]}, fused_ffn{axis_attribute(self.draw, axis)}",
                  Op((f,), (gate[0], up[0]), lambda a: ffn_unfuse(see(a[0]), shards, axis),
                     lambda a: [see(ffn_fuse(a[0], a[1], shards, axis))]))
        for out in (gate, up):
            self.finish(out, self.fused_shape(axis, half, other), piece=True)

    def ffn_relayout(self) -> None:
        """`f -> g, fused_ffn`: from the source's shards to the destination's."""
        axis = self.draw(st.sampled_from([0, 1]))
        source = self.reads_count() or self.count()
        target = self.writes_count() or self.count(source)
        half = lcm(source, target) * self.draw(st.integers(1, 2))
        other = self.draw(st.integers(1, 3))
        shape = self.fused_shape(axis, 2 * half, other)
        fused, f, see = self.part(shape, source)
        out = self.out()
        self.emit(f"{fused} -> {out[0]}, fused_ffn{axis_attribute(self.draw, axis)}",
                  Op((f,), (out[0],),
                     lambda a: [ffn_fuse(*ffn_unfuse(see(a[0]), source, axis), target, axis)],
                     lambda a: [see(ffn_fuse(*ffn_unfuse(a[0], target, axis), source, axis))]))
        self.finish(out, shape, shards=target)

    def two_fused(self) -> None:
        """A fused tensor that one fused statement writes and another reads: in between it
        is laid out as one shard."""
        axis = self.draw(st.sampled_from([0, 1]))
        other = self.draw(st.integers(1, 2))
        if self.draw(st.booleans()):  # f -> t, fused_ffn; t -> g, fused_ffn
            source = self.reads_count() or self.count()
            target = self.writes_count() or self.count(source)
            half = lcm(source, target) * self.draw(st.integers(1, 2))
            shape = self.fused_shape(axis, 2 * half, other)
            fused, f, see = self.part(shape, source)
            middle = self.name()
            self.emit(f"{fused} -> {middle}, fused_ffn{axis_attribute(self.draw, axis)}",
                      Op((f,), (middle,), lambda a: [ffn_fuse(*ffn_unfuse(see(a[0]), source,
                                                                          axis), 1, axis)],
                         lambda a: [see(ffn_fuse(*ffn_unfuse(a[0], 1, axis), source, axis))]))
            middle, _, _ = self.chain(middle, shape, "float32", casts=False, reshape=False)
            out = self.out()
            self.emit(f"{middle} -> {out[0]}, fused_ffn{axis_attribute(self.draw, axis)}",
                      Op((middle,), (out[0],),
                         lambda a: [ffn_fuse(*ffn_unfuse(a[0], 1, axis), target, axis)],
                         lambda a: [ffn_fuse(*ffn_unfuse(a[0], target, axis), 1, axis)]))
            self.finish(out, shape, shards=target)
            return
        # g, u -> t, fused_ffn; t -> g2, u2, fused_ffn: the halves come back
        half = self.draw(st.integers(1, 3))
        shape = self.fused_shape(axis, half, other)
        (gate, g, see_g), (up, u, see_u) = self.part(shape), self.part(shape)
        middle = self.name()
        self.emit(f"{gate}, {up} -> {middle}, fused_ffn{axis_attribute(self.draw, axis)}",
                  Op((g, u), (middle,), lambda a: [ffn_fuse(see_g(a[0]), see_u(a[1]), 1, axis)],
                     lambda a: [f(x) for f, x in zip((see_g, see_u),
                                                     ffn_unfuse(a[0], 1, axis))]))
        middle, _, _ = self.chain(middle, self.fused_shape(axis, 2 * half, other), "float32",
                                  casts=False, reshape=False)
        outs = self.out(), self.out()
        self.emit(f"{middle} -> {outs[0][0]}, {outs[1][0]}, fused_ffn"
                  f"{axis_attribute(self.draw, axis)}",
                  Op((middle,), (outs[0][0], outs[1][0]), lambda a: ffn_unfuse(a[0], 1, axis),
                     lambda a: [ffn_fuse(a[0], a[1], 1, axis)]))
        for out in outs:
            self.finish(out, shape, piece=True)

    def fused_into_split(self) -> None:
        """A fused tensor that reaches its destination keys through a split: laid out for
        their shards (both keys have the same count)."""
        shards = self.writes_count() or self.count()
        half, rows = shards * self.draw(st.integers(1, 2)), 2 * self.draw(st.integers(1, 2))
        (gate, g, see_g), (up, u, see_u) = self.part((rows, half)), self.part((rows, half))
        fused = self.name()
        self.emit(f"{gate}, {up} -> {fused}, fused_ffn",
                  Op((g, u), (fused,), lambda a: [ffn_fuse(see_g(a[0]), see_u(a[1]), shards, 1)],
                     lambda a: [f(x) for f, x in zip((see_g, see_u),
                                                     ffn_unfuse(a[0], shards, 1))]))
        axis = self.draw(st.integers(0, 1))
        pieces = [self.out(), self.out()]
        self.split(fused, [p[0] for p in pieces], axis)
        piece = (rows // 2, 2 * half) if axis == 0 else (rows, half)
        for out in pieces:
            self.finish(out, piece, shards=shards, piece=True)

    def fused_from_concat(self) -> None:
        """A fused tensor read from a concat of source keys: laid out as they are."""
        shards = self.reads_count() or self.count()
        half, rows = shards * self.draw(st.integers(1, 2)), self.draw(st.integers(1, 2))
        keys = [self.name("s"), self.name("s")]
        for key in keys:
            self.source(key, (rows, 2 * half), shards=shards)
        joined = self.name()
        self.concat(keys, joined, 0)
        gate, up = self.out(), self.out()
        self.emit(f"{joined} -> {gate[0]}, {up[0]}, fused_ffn",
                  Op((joined,), (gate[0], up[0]), lambda a: ffn_unfuse(a[0], shards, 1),
                     lambda a: [ffn_fuse(a[0], a[1], shards, 1)]))
        for out in (gate, up):
            self.finish(out, (2 * rows, half), piece=True)

    # fused_qkv_old ---------------------------------------------------------------------------
    def heads(self, *counts: int) -> tuple[int, int, int]:
        """num_heads, num_key_value_groups (divisible by every count) and a head size."""
        groups = lcm(*counts) * self.draw(st.integers(1, 2))
        return groups * self.draw(st.integers(1, 3)), groups, self.draw(st.integers(1, 2))

    def qkv_old_merge(self) -> None:
        axis = self.draw(st.sampled_from([0, 1]))
        shards = self.writes_count() or self.count()
        heads, groups, head = self.heads(shards)
        other = self.draw(st.integers(1, 2))
        sizes = [n * head for n in (heads, groups, groups)]
        if shards == 1 and not self.program.reverse and self.draw(st.booleans()):
            # over one shard: the parts' plain concat, in any proportion
            sizes = [self.draw(st.integers(1, 6)) for _ in range(3)]
        parts = [self.part(self.fused_shape(axis, size, other)) for size in sizes]
        (q, k, v) = (p[0] for p in parts)
        sees = [p[2] for p in parts]
        out = self.out()
        self.emit(f"{q}, {k}, {v} -> {out[0]}, fused_qkv_old, num_heads={heads}, "
                  f"num_key_value_groups={groups}{axis_attribute(self.draw, axis)}",
                  Op(tuple(p[1] for p in parts), (out[0],),
                     lambda a: [qkv_old_fuse(*(f(x) for f, x in zip(sees, a)), heads, groups,
                                             shards, axis)],
                     lambda a: [f(x) for f, x in zip(sees, qkv_old_unfuse(
                         a[0], heads, groups, shards, axis))]))
        self.finish(out, self.fused_shape(axis, sum(sizes), other), shards=shards)

    def qkv_old_split(self) -> None:
        axis = self.draw(st.sampled_from([0, 1]))
        shards = self.reads_count() or self.count()
        heads, groups, head = self.heads(shards)
        other = self.draw(st.integers(1, 2))
        fused, f, see = self.part(self.fused_shape(axis, (heads + 2 * groups) * head, other),
                                  shards)
        outs = [self.out() for _ in range(3)]
        self.emit(f"{fused} -> {', '.join(o[0] for o in outs)}, fused_qkv_old, "
                  f"num_heads={heads}, num_key_value_groups={groups}"
                  f"{axis_attribute(self.draw, axis)}",
                  Op((f,), tuple(o[0] for o in outs),
                     lambda a: qkv_old_unfuse(see(a[0]), heads, groups, shards, axis),
                     lambda a: [see(qkv_old_fuse(*a, heads, groups, shards, axis))]))
        for out, n in zip(outs, (heads, groups, groups)):
            self.finish(out, self.fused_shape(axis, n * head, other), piece=True)

    def qkv_old_relayout(self) -> None:
        axis = self.draw(st.sampled_from([0, 1]))
        source = self.reads_count() or self.count()
        target = self.writes_count() or self.count(source)
        heads, groups, head = self.heads(source, target)
        shape = self.fused_shape(axis, (heads + 2 * groups) * head, self.draw(st.integers(1, 2)))
        fused, f, see = self.part(shape, source)
        out = self.out()

        def relayout(x, start: int, end: int):
            return qkv_old_fuse(*qkv_old_unfuse(x, heads, groups, start, axis), heads, groups,
                                end, axis)

        self.emit(f"{fused} -> {out[0]}, fused_qkv_old, num_heads={heads}, "
                  f"num_key_value_groups={groups}{axis_attribute(self.draw, axis)}",
                  Op((f,), (out[0],), lambda a: [relayout(see(a[0]), source, target)],
                     lambda a: [see(relayout(a[0], target, source))]))
        self.finish(out, shape, shards=target)

    # fused_qkv -------------------------------------------------------------------------------
    def qkv_merge(self) -> None:
        axis = self.draw(st.sampled_from([0, 1]))
        heads, groups, head = self.heads(1)
        # a forward merge takes query heads of another size too (Qwen3-Next's gated query)
        query = head * (1 if self.program.reverse else self.draw(st.integers(1, 2)))
        other = self.draw(st.integers(1, 2))
        parts = [self.part(self.fused_shape(axis, n * size, other))
                 for n, size in ((heads, query), (groups, head), (groups, head))]
        sees = [p[2] for p in parts]
        self.lookalikes += [p[1] + "0" for p in parts]
        out = self.out()
        self.emit(f"{', '.join(p[0] for p in parts)} -> {out[0]}, fused_qkv, num_heads={heads}, "
                  f"num_key_value_groups={groups}{axis_attribute(self.draw, axis)}",
                  Op(tuple(p[1] for p in parts), (out[0],),
                     lambda a: [qkv_fuse(*(f(x) for f, x in zip(sees, a)), heads, groups, axis)],
                     lambda a: [f(x) for f, x in zip(sees, qkv_unfuse(a[0], heads, groups,
                                                                       axis))]))
        self.finish(out, self.fused_shape(axis, heads * query + 2 * groups * head, other))

    def qkv_split(self) -> None:
        axis = self.draw(st.sampled_from([0, 1]))
        heads, groups, head = self.heads(1)
        other = self.draw(st.integers(1, 2))
        fused, f, see = self.part(self.fused_shape(axis, (heads + 2 * groups) * head, other))
        outs = [self.out() for _ in range(3)]
        self.lookalikes += [o[0] + "0" for o in outs]
        self.emit(f"{fused} -> {', '.join(o[0] for o in outs)}, fused_qkv, num_heads={heads}, "
                  f"num_key_value_groups={groups}{axis_attribute(self.draw, axis)}",
                  Op((f,), tuple(o[0] for o in outs),
                     lambda a: qkv_unfuse(see(a[0]), heads, groups, axis),
                     lambda a: [see(qkv_fuse(*a, heads, groups, axis))]))
        for out, n in zip(outs, (heads, groups, groups)):
            self.finish(out, self.fused_shape(axis, n * head, other), piece=True)

    # names a careless macro would capture ----------------------------------------------------
    def traps(self, first: list, last: list) -> None:
        """Tensors named like the pieces and views macros make: a source key read at the
        end, or a temporary written at the start and read at the end."""
        names = {"fused_ffn_tmp.GATE_0", "fused_ffn_tmp.UP_1", "fused_qkv_old_tmp.Q_0",
                 "fused_qkv_old_tmp.K_0", "fused_qkv_tmp.Q_1", "fused_qkv_tmp.V_0",
                 *(n for n in self.lookalikes if "$" not in n)}
        taken = set(self.program.sources) | set(self.program.destinations)
        taken.update(name for block in self.blocks for _, ops in block for op in ops
                     for name in (*op.reads, *op.writes))
        free = sorted(names - taken)
        chosen = self.draw(st.lists(st.sampled_from(free), max_size=3, unique=True)) if free else []
        for trap in chosen:
            destination = self.name("d")
            if self.draw(st.booleans()):
                self.source(trap, (2, 3))
            else:
                key = self.name("s")
                self.source(key, (2, 3))
                first.append((f"{key} -> {trap}", [Op((key,), (trap,), lambda a: a,
                                                      lambda a: a)]))
            last.append((f"{trap} -> {destination}", [Op((trap,), (destination,),
                                                         lambda a: a, lambda a: a)]))
            self.destination(destination, (2, 3), "float32")


FORWARD_ONLY = {"tied", "drop"}
BLOCKS = ("plain", "identity", "tied", "drop", "layer_offset", "star_concat", "star_split",
          "array_split",
          "ffn_merge", "ffn_split", "ffn_relayout", "two_fused", "fused_into_split",
          "fused_from_concat", "qkv_old_merge", "qkv_old_split", "qkv_old_relayout",
          "qkv_merge", "qkv_split")
#: blocks written as one statement, which a template may hold in a reverse run too
ONE_STATEMENT = ("plain", "ffn_merge", "ffn_split", "ffn_relayout", "qkv_old_merge",
                 "qkv_old_split", "qkv_old_relayout", "qkv_merge", "qkv_split")


@st.composite
def programs(draw) -> Program:
    reverse = draw(st.booleans())
    derive = draw(st.integers(0, 3)) == 0
    blocks = Blocks(draw, reverse, derive)
    kinds = [k for k in BLOCKS if not (reverse and k in FORWARD_ONLY)]
    if derive:  # `*` needs the keys of the side it matches
        kinds.remove("star_concat" if reverse else "star_split")
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=5)):
        if kind in ONE_STATEMENT and draw(st.integers(0, 3)) == 0:
            blocks.layers = {"$LAYER_ID": sorted(draw(st.sets(st.integers(0, 11), min_size=1,
                                                              max_size=3)))}
            if draw(st.booleans()):
                blocks.layers["$EXPERT_ID"] = sorted(draw(st.sets(st.integers(0, 11),
                                                                  min_size=1, max_size=2)))
        getattr(blocks, kind)()
        blocks.end_block()
    first: list = []
    last: list = []
    blocks.traps(first, last)
    items = first + interleave(draw, blocks.blocks) + last
    program = blocks.program
    program.statements = glue(draw, [text for text, _ in items if text])
    program.ops = [op for _, ops in items for op in ops]
    return program


def glue(draw, statements: list[str]) -> list[str]:
    """Now and then two statements in one list item: each is still a statement of its own
    (README, Decisions; Paddle runs a macro over the whole item)."""
    out: list[str] = []
    for statement in statements:
        if out and draw(st.integers(0, 5)) == 0:
            out[-1] += " " + statement
        else:
            out.append(statement)
    return out


def interleave(draw, blocks: list[list]) -> list:
    """The blocks' statements in one order that keeps each block's own order."""
    queues = [list(block) for block in blocks if block]
    out = []
    while queues:
        queue = queues[draw(st.integers(0, len(queues) - 1))]
        out.append(queue.pop(0))
        if not queue:
            queues.remove(queue)
    return out
