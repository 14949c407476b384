"""Mesh layouts: destination shards derived from a mesh and rules, so nobody lists shards by
hand (the TOML file `aoa convert --layout` takes).

A layout file (TOML) names the mesh and, per key pattern, which axis each mesh dimension
splits; a dimension a rule does not name replicates the tensor:

    [mesh]            # ranks are numbered row-major over the dimensions, in this order
    tp = 2

    [[rule]]
    match = "layers.*.self_attn.qkv_proj.weight"   # shell-style pattern over destination keys
    tp = 1                                          # tp splits axis 1

An axis made of equal blocks side by side (Megatron's ``linear_fc1``: gate rows, then up
rows) can be split block by block, so each rank holds its part of every block, as Megatron's
gated MLP is split under tensor parallelism (rank r: gate part r and up part r):

    [[rule]]
    match = "decoder.layers.*.mlp.linear_fc1.weight"
    tp = { axis = 0, blocks = 2 }

A mesh dimension can also place whole tensors instead of splitting them (expert and
pipeline parallelism): the tensor lives only on the ranks of one position along it.

    [[rule]]
    match = "layers.*.mlp.experts.*"
    ep = { number_after = "experts.", of = 8 }      # expert e of 8 on ep position e * ep // 8
    pp = { number_after = "layers.", of = 24 }      # layer l on its pipeline stage
    # pp = "first" / "last": the first or the last position (embeddings, the head)

Layers go to stages as Paddle's pipeline segments them (`SegmentLayers.uniform`: equal parts,
the later stages one more when they do not divide); a number at or past `of` (a
multi-token-prediction layer after the last decoder layer) goes to the last position.

The first rule that matches a key decides; a key no rule matches is replicated on every rank.
Optimizer states (`.moment1_0`, ...) follow their parameter's rule; beta pows are replicated.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aoa.errors import UsageError, quote
from aoa.inputs import read_text
from aoa.layout import BETA_POW_SUFFIXES, ShardDesc, split_optimizer_suffix
from aoa.limits import MAX_NUMBER_DIGITS, MAX_RANKS


@dataclass(frozen=True)
class Placement:
    """A mesh dimension that places a whole tensor on one of its positions."""

    number_after: str | None = None  # the position comes from the number after this text
    of: int = 0  # ... out of this many (layers, experts)
    where: str | None = None  # or "first" / "last"

    def position(self, key: str, size: int) -> int:
        if self.where is not None:
            return 0 if self.where == "first" else size - 1
        assert self.number_after is not None
        start = key.find(self.number_after)
        digits = ""
        if start >= 0:
            rest = key[start + len(self.number_after):]
            digits = rest[:len(rest) - len(rest.lstrip("0123456789"))]
        if not digits:
            raise UsageError(f"'{key}' has no number after '{self.number_after}' to place it by")
        significant = digits.lstrip("0") or "0"
        if len(significant) > MAX_NUMBER_DIGITS or int(significant) >= self.of:
            return size - 1
        number = int(significant)
        # Paddle's SegmentLayers.uniform: the boundary after part i moves one further for the
        # parts after (size - extra).
        part, extra = divmod(self.of, size)
        end = 0
        for index in range(1, size):
            end += part + (1 if index > size - extra else 0)
            if number < end:
                return index - 1
        return size - 1

    def to_toml(self) -> str:
        if self.where is not None:
            return f'"{self.where}"'
        return f'{{ number_after = "{self.number_after}", of = {self.of} }}'


@dataclass(frozen=True)
class Rule:
    match: str
    axes: dict[str, int]  # mesh dimension -> tensor axis it splits
    places: dict[str, Placement] = field(default_factory=dict)  # mesh dimension -> placement
    blocks: dict[int, int] = field(default_factory=dict)  # axis -> equal blocks, each split


@dataclass(frozen=True)
class MeshShards:
    """The destination shards of a mesh layout: by key, in the order the compiler takes
    them, and each rank's as positions in that order (the key-by-key listing)."""

    by_key: dict[str, list[ShardDesc]]
    ranks: list[list[int]]

    def listed(self) -> list[ShardDesc]:
        """Every shard, key by key: what the positions in ``ranks`` count."""
        return [shard for shards in self.by_key.values() for shard in shards]

    def of_rank(self, rank: int) -> list[ShardDesc]:
        listed = self.listed()
        return [listed[position] for position in self.ranks[rank]]


@dataclass(frozen=True)
class MeshLayout:
    """A mesh (dimension name -> size) and the rules that say which tensor axis each
    dimension splits, per key pattern."""

    mesh: dict[str, int]
    rules: tuple[Rule, ...]
    source: str = "<layout>"

    @property
    def ranks(self) -> int:
        count = 1
        for size in self.mesh.values():
            count *= size
        return count

    def coordinates(self) -> list[dict[str, int]]:
        """Each rank's position on the mesh, rank 0 first."""
        names = list(self.mesh)
        return [dict(zip(names, position))
                for position in itertools.product(*(range(self.mesh[n]) for n in names))]

    def rule_for(self, key: str) -> Rule | None:
        return next((rule for rule in self.rules if fnmatch.fnmatchcase(key, rule.match)), None)

    def shards(self, outputs: Mapping[str, tuple[tuple[int, ...], str | None]], *,
               strict: bool = False) -> MeshShards:
        """The shards of outputs given as key -> (shape, dtype), by key and by rank.
        ``strict``: a rule that decides no key is an error (its tensors, misspelt, would be
        replicated on every rank without a word)."""
        by_key: dict[str, list[ShardDesc]] = {}
        by_rank: list[list[int]] = [[] for _ in range(self.ranks)]
        count = 0
        decided: set[int] = set()
        for key, (shape, dtype) in outputs.items():
            # Optimizer states are sharded like their parameter; beta pows are replicated.
            model_key, suffix = split_optimizer_suffix(key)
            rule = None if suffix in BETA_POW_SUFFIXES else self.rule_for(model_key)
            if rule is not None:
                decided.add(id(rule))
            axes = rule.axes if rule else {}
            owners = {name: place.position(model_key, self.mesh[name])
                      for name, place in (rule.places if rule else {}).items()}
            for axis in axes.values():
                if axis >= len(shape):
                    raise UsageError(f"{self.source}: rule '{rule.match if rule else ''}' splits "
                                     f"axis {axis} of '{key}', which has shape {list(shape)}")
            per_axis: dict[int, int] = {}
            for name, axis in axes.items():
                per_axis[axis] = per_axis.get(axis, 1) * self.mesh[name]
            blocks = {axis: rule.blocks.get(axis, 1) if rule else 1 for axis in per_axis}
            for axis, parts in per_axis.items():
                if shape[axis] % (parts * blocks[axis]):
                    what = (f"{blocks[axis]} blocks of " if blocks[axis] > 1 else "")
                    raise UsageError(f"{self.source}: '{key}' has {shape[axis]} on axis {axis}, "
                                     f"which does not split into {what}{parts} equal shards")
            shards = by_key.setdefault(key, [])
            for rank, position in enumerate(self.coordinates()):
                if any(position[name] != owner for name, owner in owners.items()):
                    continue
                local, start = list(shape), [0] * len(shape)
                # Dimensions that split the same axis nest in mesh order (the first is outer).
                for axis, parts in per_axis.items():
                    local[axis] = shape[axis] // (parts * blocks[axis])
                    index = 0
                    for name, split_axis in axes.items():
                        if split_axis == axis:
                            index = index * self.mesh[name] + position[name]
                    start[axis] = index * local[axis]
                # A rank holds its part of each block of a blocked axis: one shard per block.
                block_axes = [axis for axis in per_axis if blocks[axis] > 1]
                for block in itertools.product(*(range(blocks[axis]) for axis in block_axes)):
                    offset = list(start)
                    for axis, number in zip(block_axes, block):
                        offset[axis] += number * shape[axis] // blocks[axis]
                    shards.append(ShardDesc(key, tuple(local), tuple(shape), tuple(offset),
                                            dtype))
                    by_rank[rank].append(count)
                    count += 1
        if strict:
            self._check_rules_decide(decided, outputs)
        return MeshShards(by_key, by_rank)

    def _check_rules_decide(self, decided: set[int], outputs: Mapping[str, object]) -> None:
        for number, rule in enumerate(self.rules, 1):
            if id(rule) in decided:
                continue
            keys = [split_optimizer_suffix(key)[0] for key in outputs]
            matched = [key for key in keys if fnmatch.fnmatchcase(key, rule.match)]
            if matched:
                why = (f"matches only keys an earlier rule decides (first match wins), such "
                       f"as '{matched[0]}'")
                hint = "Move it before the rule that takes its keys, or delete it."
            else:
                why = "matches no tensor the mapping makes"
                import difflib  # (for this message only)

                close = difflib.get_close_matches(rule.match, keys, n=1)
                like = f" (a key like it: '{close[0]}')" if close else ""
                hint = (f"Check the pattern against the destination keys{like}; a tensor no "
                        "rule decides is replicated on every rank.")
            raise UsageError(f"{self.source}: rule {number} (match = \"{rule.match}\") "
                             f"{why}", hint=hint + " --lenient (strict=False) lets such a "
                             "rule decide nothing.")


def read_mesh_layout(path: str | Path) -> MeshLayout:
    import tomllib  # here: every `aoa convert` imports this module, few read a layout

    path = Path(path)
    try:
        data = tomllib.loads(read_text(path, "layout"))
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{path}: not valid TOML: {error}") from None
    except ValueError:  # Python's int() refused the number's digits
        raise UsageError(f"{path}: not valid TOML: a number has more than "
                         f"{sys.get_int_max_str_digits()} digits") from None
    return parse_mesh_layout(data, str(path))


def parse_mesh_layout(data: Mapping, source: str = "<layout>") -> MeshLayout:
    mesh = data.get("mesh")
    if not isinstance(mesh, Mapping) or not mesh:
        raise UsageError(f"{source}: needs a [mesh] table, e.g. `[mesh]` then `tp = 2`")
    for name, size in mesh.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise UsageError(f"{source}: mesh dimension {name} = {quote(size)} must be a "
                             "positive integer")
        if size > MAX_RANKS:
            raise UsageError(f"{source}: mesh dimension {name} = {quote(size)} is more than "
                             f"{MAX_RANKS} ranks")
    ranks = math.prod(mesh.values())
    if ranks > MAX_RANKS:
        many = ranks if ranks < 2**63 else "over 2**63"  # (a thousand dimensions: 4,817 digits)
        raise UsageError(f"{source}: the mesh has {many} ranks, more than {MAX_RANKS}")
    given = data.get("rule", [])
    if not isinstance(given, list):
        raise UsageError(f"{source}: each rule begins with [[rule]], two brackets: 'rule' is "
                         f"{quote(given) if not isinstance(given, Mapping) else 'one table'}, "
                         "not a list of rules")
    rules = []
    for i, rule in enumerate(given):
        if not isinstance(rule, Mapping) or not isinstance(rule.get("match"), str):
            raise UsageError(f"{source}: rule {i + 1} needs match = \"key pattern\"")
        axes: dict[str, int] = {}
        places: dict[str, Placement] = {}
        blocks: dict[int, int] = {}
        for name, value in rule.items():
            if name == "match":
                continue
            where = f"{source}: rule {i + 1} ('{rule['match']}')"
            if name not in mesh:
                raise UsageError(f"{where} names '{name}', which is not a mesh dimension "
                                 f"({', '.join(mesh)})")
            if isinstance(value, Mapping) and "axis" in value:
                axes[name], count = _blocked_axis(value, f"{where}: {name}")
                if blocks.setdefault(axes[name], count) != count:
                    raise UsageError(f"{where}: axis {axes[name]} is given two block counts")
            elif isinstance(value, (str, Mapping)):
                places[name] = _placement(value, f"{where}: {name}")
            elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                axes[name] = value
            else:
                raise UsageError(f"{where}: {name} must be the axis it splits (a number from "
                                 "0, or { axis = A, blocks = B }) or a placement (\"first\", "
                                 "\"last\" or { number_after = \"...\", of = N })")
        rules.append(Rule(rule["match"], axes, places, blocks))
    extra = set(data) - {"mesh", "rule"}
    if extra:
        raise UsageError(f"{source}: unknown table(s) {', '.join(sorted(extra))}; a layout "
                         "has [mesh] and [[rule]]")
    return MeshLayout(dict(mesh), tuple(rules), source)


def _blocked_axis(value: Mapping, where: str) -> tuple[int, int]:
    axis, blocks = value.get("axis"), value.get("blocks", 1)
    if set(value) - {"axis", "blocks"} or not isinstance(axis, int) \
            or not isinstance(blocks, int) or isinstance(axis, bool) \
            or isinstance(blocks, bool) or axis < 0 or blocks < 1:
        raise UsageError(f"{where}: an axis split block by block is {{ axis = A, blocks = B }} "
                         "with A from 0 and B a positive count")
    return axis, blocks


def _placement(value: str | Mapping, where: str) -> Placement:
    if isinstance(value, str):
        if value not in ("first", "last"):
            raise UsageError(f"{where} = \"{value}\": a placement by name is \"first\" or "
                             "\"last\"")
        return Placement(where=value)
    after, of = value.get("number_after"), value.get("of")
    if set(value) != {"number_after", "of"} or not isinstance(after, str) or not after \
            or not isinstance(of, int) or isinstance(of, bool) or of < 1:
        raise UsageError(f"{where}: a placement by number is {{ number_after = \"text\", "
                         "of = N }} with N a positive count")
    return Placement(number_after=after, of=of)


def layout_text(layout: MeshLayout) -> str:
    """The layout as the TOML `read_layout` reads back."""
    lines = ["[mesh]"] + [f"{name} = {size}" for name, size in layout.mesh.items()]
    for rule in layout.rules:
        lines += ["", "[[rule]]", f'match = "{rule.match}"']
        lines += [f"{name} = {axis}" if rule.blocks.get(axis, 1) == 1 else
                  f"{name} = {{ axis = {axis}, blocks = {rule.blocks[axis]} }}"
                  for name, axis in rule.axes.items()]
        lines += [f"{name} = {place.to_toml()}" for name, place in rule.places.items()]
    return "\n".join(lines) + "\n"
