"""Expand the layout macros: `X^T`, `fused_ffn`, `fused_qkv_old`, `fused_qkv` (spec 5.6-5.10),
and PaddleFormers' `fused_in_proj`.

They rewrite one statement into splits and concats over named pieces. `fused_ffn` and
`fused_qkv_old` depend on how many shards the fused tensor has on each side, which the
chains answer (resolve_chains.py); the shard count of `X^T` is the count of `X` (spec 0.4).

The names of the pieces and transposed views are hygienic: none of them is a name the
program or either checkpoint uses, so a generated piece never stands in for a user's
tensor (Paddle's `a1` + `0` = `a10` would). Every part of a merge is cut into its own
pieces (`q -> Q_0 … Q_{H-1}`, `k -> K_…`), so the reverse run of a merge is the true split
and pieces of unequal size are caught where they are joined (propagate_shapes.py).
"""

from __future__ import annotations

import functools
import itertools
from math import lcm

from aoa.errors import MacroError
from aoa.ir import NOTHING, Attribute, Name, Program, Statement, make_name
from aoa.layout import shard_count
from aoa.limits import MAX_MACRO_NAMES
from aoa.passes.context import CompileContext
from aoa.passes.resolve_chains import ChainedProgram, Chains

NAME = "expand_fused"
TRANSPOSE_SUFFIX = "_transpose_tmp"

_ALLOWED = {
    "fused_ffn": {"fused_ffn", "axis"},
    "fused_qkv_old": {"fused_qkv_old", "axis", "num_heads", "num_key_value_groups"},
    "fused_qkv": {"fused_qkv", "axis", "num_heads", "num_key_value_groups"},
    "fused_in_proj": {"fused_in_proj", "axis", "tp_probe_key"},
}


@functools.cache
def _ffn_layout(prefix: str, shards: int, pieces: int) -> tuple[str, ...]:
    """Per shard r: its gate pieces, then its up pieces (spec 5.9's F(t, S))."""
    per = pieces // shards
    return tuple(f"{prefix}{half}_{r * per + j}" for r in range(shards)
                 for half in ("GATE", "UP") for j in range(per))


class FreshNames:
    """Names for what the layout macros make, chosen so that none is a name the program or
    either checkpoint uses (hygiene).

    A macro's pieces live under a prefix that no such name starts with (`fused_ffn_tmp.`,
    else `fused_ffn_tmp_1.`, ...); a transposed view is `X_transpose_tmp` unless that is
    taken (then `X_transpose_tmp_1`, ...). A piece is its prefix, a letter or two and a
    number; a view ends in `_transpose_tmp` or a number after it: the two never meet.
    Names are reused from statement to statement: each statement's pieces are joined
    before the next statement runs."""

    def __init__(self, program: Program, ctx: CompileContext) -> None:
        self._program = program
        self._ctx = ctx
        self._prefixes: dict[str, str] = {}
        self._views: dict[str, str] = {}

    @functools.cached_property
    def _program_names(self) -> frozenset[str]:
        """The names the program reads and writes, as written (`X^T` too: no `base` asked
        name by name). Instances set aside by share_instances bind no name (their outputs
        are their kept one's), so they need not be asked."""
        return frozenset([n.text for s in self._program.statements for n in (*s.left, *s.right)])

    @functools.cached_property
    def _names_in_use_text(self) -> str:
        """The program's names and the model-state keys of both checkpoints (an optimizer
        state's key is its parameter's and a suffix no piece or view name ends in), each
        after a newline: a prefix is then looked for at C speed (a big model has a hundred
        thousand keys). A key holding a newline can only make a prefix look taken. `X^T`
        starts with a prefix (a dot ends it, no `^` is in it) exactly when `X` does."""
        names = itertools.chain(self._program_names, self._ctx.source_keys,
                                self._ctx.destination_keys)
        return "\n" + "\n".join(names)

    def _in_use(self, name: str) -> bool:
        """Whether ``name`` (a view's, which never ends in `^T`) is in use: the program
        uses it as written or transposed, or a checkpoint holds it."""
        return (name in self._program_names or name + "^T" in self._program_names
                or name in self._ctx.source_keys or name in self._ctx.destination_keys)

    def prefix(self, stem: str) -> str:
        """`stem.` or `stem_N.`: a prefix no name in use starts with."""
        prefix = self._prefixes.get(stem)
        if prefix is None:
            prefix, number = f"{stem}.", 0
            while f"\n{prefix}" in self._names_in_use_text:
                number += 1
                prefix = f"{stem}_{number}."
            self._prefixes[stem] = prefix
        return prefix

    def view(self, base: str) -> str:
        """The name of the transposed view of ``base``."""
        name = self._views.get(base)
        if name is None:
            name, number = base + TRANSPOSE_SUFFIX, 0
            while self._in_use(name):
                number += 1
                name = f"{base}{TRANSPOSE_SUFFIX}_{number}"
            self._views[base] = name
        return name


class _Fuser:
    def __init__(self, ctx: CompileContext, chains: Chains, fresh: FreshNames) -> None:
        self.ctx = ctx
        self.chains = chains
        self.fresh = fresh
        #: the Names and axis attributes made so far, per span object (of a statement the
        #: program holds, so alive while it runs; hashing a span by value costs more than
        #: making the names), so that statements made alike share them
        self._names_by_span: dict[int, dict[str, Name]] = {}
        self._axes: dict[tuple[int, int], Attribute] = {}
        self.index = 0  # the position in the program of the statement being expanded

    def expand(self, index: int, statement: Statement) -> list[Statement]:
        self.index = index
        left, right = statement.left, statement.right
        if (len(left) == 1 and len(right) == 1 and not statement.attributes
                and not left[0].text.endswith("^T") and not right[0].text.endswith("^T")):
            return [statement]  # the usual: a rename, no macro to lay out
        for name in right:
            if name.text.endswith("^T"):
                raise MacroError(
                    f"cannot assign to the transposed view '{name.text}'", name.span,
                    hint=f"Assign first (`... -> {name.base}`), then transpose "
                         f"(`{name.base}^T -> {name.base}`).")
        helpers, renamed = self._transposes(statement)
        flags = [a for a in renamed.attributes if a.key in _ALLOWED] if renamed.attributes else ()
        if not flags:
            return [*helpers, renamed] if helpers else [renamed]
        if len(flags) > 1:
            raise MacroError(f"one statement cannot use both {flags[0].key} and "
                             f"{flags[1].key}", flags[1].span)
        flag = flags[0]
        for name in (*statement.left, *statement.right):
            if name.base == NOTHING:
                raise MacroError(f"{flag.key} cannot take '{NOTHING}' (nothing) as a tensor",
                                 name.span, hint=f"Drop a fused tensor with a statement of "
                                                 f"its own: `fused -> {NOTHING}`.")
        for attribute in renamed.attributes:
            if attribute.key not in _ALLOWED[flag.key]:
                raise MacroError(
                    f"{flag.key} does not take '{attribute.key}'", attribute.span,
                    hint=f"{flag.key} accepts only " + ", ".join(
                        sorted(_ALLOWED[flag.key] - {flag.key})) +
                    "; write casts and renames as statements of their own.")
        axis = self._int(renamed, flag, "axis", 1)
        macro = getattr(self, flag.key)
        return [*helpers, *macro(statement, renamed, flag, axis)]

    def _transposes(self, statement: Statement) -> tuple[list[Statement], Statement]:
        """`X^T` on the left: a helper `X -> X_transpose_tmp, permute="[]"` per name."""
        for name in statement.left:
            if name.text.endswith("^T"):
                break
        else:
            return [], statement
        helpers: list[Statement] = []
        left: list[Name] = []
        seen: dict[str, Name] = {}
        permute = Attribute("permute", "[]", statement.span)
        for name in statement.left:
            if not name.text.endswith("^T"):
                left.append(name)
                continue
            base = name.text[:-2]
            view = seen.get(base)
            if view is None:
                view = seen[base] = Name(self.fresh.view(base), name.span)
                helpers.append(statement.derive("transpose", (Name(base, name.span),), (view,),
                                                (permute,)))
            left.append(view)
        return helpers, statement.derive("transpose", left, statement.right,
                                         statement.attributes)

    @staticmethod
    def _int(statement: Statement, flag: Attribute, key: str, default: int | None) -> int:
        attribute = statement.attribute(key)
        if attribute is None:
            if default is None:
                raise MacroError(f"{flag.key} needs {key}=N", flag.span)
            return default
        if not isinstance(attribute.value, int):
            raise MacroError(f"{key} must be a number, not {attribute.value!r}", attribute.span)
        return attribute.value

    @staticmethod
    def _span_of_attribute(statement: Statement, key: str):
        attribute = statement.attribute(key)
        return attribute.span if attribute is not None else statement.span

    def _count(self, written: Statement, name: Name) -> int:
        left = any(n is name for n in written.left)
        return self.chains.shard_count(self.index, name.base, left=left)

    def _make(self, parent: Statement, macro: str, left, right, axis: int, span) -> Statement:
        """A split or concat of pieces; with one piece on each side, a plain rename (not
        Paddle's alias, which would hide the name the user wrote from derived outputs)."""
        left, right = self._names(left, span), self._names(right, span)
        attributes = (self._axis(axis, span),) if len(left) > 1 or len(right) > 1 else ()
        return parent.derive(macro, left, right, attributes)

    def _plain_concat(self, s: Statement, macro: str, axis: int, span) -> Statement:
        """A forward merge laid out over one shard: the parts one after the other. Paddle's
        cut into equal pieces and join gives the same bytes, whatever the parts' sizes
        (a reverse run cuts each part into its own pieces instead, to split them back)."""
        return self._make(s, macro, list(s.left), [s.right[0]], axis, span)

    def _names(self, names, span) -> tuple[Name, ...]:
        """Names for generated pieces, shared across statements (they repeat per layer)."""
        made = self._names_by_span.get(id(span))
        if made is None:
            made = self._names_by_span[id(span)] = {}
        result = []
        for name in names:
            if isinstance(name, Name):
                result.append(name)
                continue
            named = made.get(name)
            if named is None:
                named = made[name] = make_name(name, span)
            result.append(named)
        return tuple(result)

    def _axis(self, axis: int, span) -> Attribute:
        key = (axis, id(span))
        made = self._axes.get(key)
        if made is None:
            made = self._axes[key] = Attribute("axis", axis, span)
        return made

    def _heads(self, statement: Statement, flag: Attribute) -> tuple[int, int]:
        heads = self._int(statement, flag, "num_heads", None)
        groups = self._int(statement, flag, "num_key_value_groups", None)
        for key, value in (("num_heads", heads), ("num_key_value_groups", groups)):
            if value <= 0:
                raise MacroError(f"{key} must be positive (got {value})",
                                 self._span_of_attribute(statement, key))
            if value > MAX_MACRO_NAMES:
                raise MacroError(f"{key}={value} is more than {MAX_MACRO_NAMES}",
                                 self._span_of_attribute(statement, key),
                                 hint=f"{flag.key} makes one piece per head.")
        if heads % groups:
            raise MacroError(f"num_heads ({heads}) must be divisible by num_key_value_groups "
                             f"({groups})", self._span_of_attribute(statement, "num_heads"),
                             hint="num_key_value_groups is the number of key/value heads.")
        return heads, groups

    # fused_ffn ---------------------------------------------------------------------------
    def fused_ffn(self, written: Statement, s: Statement, flag: Attribute, axis: int):
        prefix = self.fresh.prefix("fused_ffn_tmp")

        def layout(shards: int, pieces: int) -> tuple[str, ...]:
            return _ffn_layout(prefix, shards, pieces)

        span = flag.span
        if len(s.left) == 1 and len(s.right) in (1, 2):
            source = s.left[0]
            src_shards = self._count(written, written.left[0])
            dst_shards = self._count(written, written.right[0]) if len(s.right) == 1 else 1
            pieces = lcm(src_shards, dst_shards)
            if pieces > MAX_MACRO_NAMES:
                raise MacroError(
                    f"the {src_shards} source and {dst_shards} destination shards of "
                    f"'{source.text}' would cut it into {pieces} pieces, more than "
                    f"{MAX_MACRO_NAMES}", span,
                    hint="fused_ffn cuts the tensor into the least common multiple of the "
                         "two shard counts.")
            out = [self._make(s, "fused_ffn", [source], layout(src_shards, pieces), axis, span)]
            if len(s.right) == 1:
                out.append(self._make(s, "fused_ffn", layout(dst_shards, pieces), [s.right[0]],
                                      axis, span))
            else:
                for half, target in zip(("GATE", "UP"), s.right):
                    out.append(self._make(s, "fused_ffn",
                                          [f"{prefix}{half}_{i}" for i in range(pieces)],
                                          [target], axis, span))
            return out
        if len(s.left) == 2 and len(s.right) == 1:
            shards = self._count(written, written.right[0])
            if shards == 1 and not self.ctx.reverse:
                return [self._plain_concat(s, "fused_ffn", axis, span)]
            return [*(self._make(s, "fused_ffn", [whole],
                                 [f"{prefix}{half}_{i}" for i in range(shards)], axis, span)
                      for half, whole in zip(("GATE", "UP"), s.left)),
                    self._make(s, "fused_ffn", layout(shards, shards), [s.right[0]], axis,
                               span)]
        raise MacroError(
            "fused_ffn takes `fused -> fused`, `fused -> gate, up` or `gate, up -> fused`",
            s.span, hint="Write one fused tensor on one side of '->'.")

    # fused_qkv_old -----------------------------------------------------------------------
    def fused_qkv_old(self, written: Statement, s: Statement, flag: Attribute, axis: int):
        heads, groups = self._heads(s, flag)
        prefix = self.fresh.prefix("fused_qkv_old_tmp")
        counts = {"Q": heads, "K": groups, "V": groups}

        def layout(shards: int, name: Name) -> list[str]:
            for what, count in (("num_heads", heads), ("num_key_value_groups", groups)):
                if count % shards:
                    raise MacroError(
                        f"{what}={count} does not divide over the {shards} shards of "
                        f"'{name.base}'", self._span_of_attribute(s, what),
                        hint="Each shard must hold whole query and key/value heads.")
            q, kv = heads // shards, groups // shards
            return [f"{prefix}{letter}_{r * n + i}" for r in range(shards)
                    for letter, n in (("Q", q), ("K", kv), ("V", kv)) for i in range(n)]

        def pieces(letter: str) -> list[str]:
            return [f"{prefix}{letter}_{i}" for i in range(counts[letter])]

        span = flag.span
        if len(s.left) == 1 and len(s.right) in (1, 3):
            src_shards = self._count(written, written.left[0])
            out = [self._make(s, "fused_qkv_old", [s.left[0]], layout(src_shards, s.left[0]),
                              axis, span)]
            if len(s.right) == 1:
                dst_shards = self._count(written, written.right[0])
                out.append(self._make(s, "fused_qkv_old", layout(dst_shards, s.right[0]),
                                      [s.right[0]], axis, span))
            else:
                out += [self._make(s, "fused_qkv_old", pieces(letter), [target], axis, span)
                        for letter, target in zip("QKV", s.right)]
            return out
        if len(s.left) == 3 and len(s.right) == 1:
            dst_shards = self._count(written, written.right[0])
            if dst_shards == 1 and not self.ctx.reverse:
                return [self._plain_concat(s, "fused_qkv_old", axis, span)]
            return [*(self._make(s, "fused_qkv_old", [whole], pieces(letter), axis, span)
                      for letter, whole in zip("QKV", s.left)),
                    self._make(s, "fused_qkv_old", layout(dst_shards, s.right[0]),
                               [s.right[0]], axis, span)]
        raise MacroError("fused_qkv_old takes `fused -> fused`, `fused -> q, k, v` or "
                         "`q, k, v -> fused`", s.span)

    # fused_qkv ---------------------------------------------------------------------------
    def fused_qkv(self, written: Statement, s: Statement, flag: Attribute, axis: int):
        heads, groups = self._heads(s, flag)
        per_group = heads // groups
        span = flag.span
        if len(s.left) == 1 and len(s.right) == 3:
            q, k, v = s.right
        elif len(s.left) == 3 and len(s.right) == 1:
            q, k, v = s.left
        else:
            raise MacroError("fused_qkv takes `q, k, v -> fused` or `fused -> q, k, v`",
                             s.span)
        if (len(s.left) == 3) != self.ctx.reverse:  # the fused tensor is written
            self._check_groups(written, flag, groups)
        prefix = self.fresh.prefix("fused_qkv_tmp")
        q_names = [f"{prefix}Q_{i}" for i in range(heads)]
        k_names = [f"{prefix}K_{g}" for g in range(groups)]
        v_names = [f"{prefix}V_{g}" for g in range(groups)]
        grouped = [name for g in range(groups)
                   for name in (*q_names[g * per_group:(g + 1) * per_group], k_names[g],
                                v_names[g])]
        parts = ((q, q_names), (k, k_names), (v, v_names))
        if len(s.left) == 1:
            return [self._make(s, "fused_qkv", [s.left[0]], grouped, axis, span),
                    *(self._make(s, "fused_qkv", names, [whole], axis, span)
                      for whole, names in parts)]
        return [*(self._make(s, "fused_qkv", [whole], names, axis, span)
                  for whole, names in parts),
                self._make(s, "fused_qkv", grouped, [s.right[0]], axis, span)]


    def _check_groups(self, written: Statement, flag: Attribute, groups: int) -> None:
        """The fused tensor fused_qkv writes holds its groups one after another, and its
        shards (one per tensor-parallel rank) cut it in equal parts: unless the groups
        divide over them, a rank gets a part of a group, query heads without their key and
        value, which no attention can use. Paddle writes it so."""
        fused = written.right[0] if len(written.left) == 3 else written.left[0]
        shards = self._count(written, fused)
        if shards > 1 and groups % shards:
            self.ctx.mistake(MacroError(
                f"fused_qkv writes '{fused.base}' as {groups} key/value groups, which do not "
                f"divide over its {shards} shards: a group would be split between ranks",
                self._span_of_attribute(written, "num_key_value_groups"),
                hint=f"num_key_value_groups must be a multiple of the {shards} shards (repeat "
                     "the key/value heads up to one first), or lay the tensor out over fewer "
                     "shards; --lenient (strict=False) writes it as Paddle does."))

    # fused_in_proj -----------------------------------------------------------------------
    def fused_in_proj(self, written: Statement, s: Statement, flag: Attribute, axis: int):
        """PaddleFormers 1.2.0's macro for Qwen3.5's linear attention (it registers it in
        Paddle's macro table; Paddle 3.3.1 has none): `a, b, ... -> fused, fused_in_proj,
        axis=A, tp_probe_key=KEY` cuts each source into as many equal pieces as KEY (else
        the destination) has shards and lays them out rank by rank, [a_r, b_r, ...] for
        each r, so that a plain split gives every rank its share of every part, however
        unequal the parts. One shard: the parts one after the other."""
        span = flag.span
        if len(s.left) < 2 or len(s.right) != 1:
            raise MacroError("fused_in_proj takes `a, b, ... -> fused` (two sources or more)",
                             s.span, hint="Split a fused tensor back with a statement per "
                                          "part size (its parts may differ in size).")
        if self.ctx.reverse:
            raise MacroError("fused_in_proj cannot run backwards: its parts may differ in "
                             "size, and the fused tensor does not say where one ends", span,
                             hint="Write the way back as splits into equal chunks and "
                                  "concats of them, as PaddleFormers' inverse does.")
        shards = self._probe_count(written, s)
        if shards == 1:
            return [self._plain_concat(s, "fused_in_proj", axis, span)]
        if shards * len(s.left) > MAX_MACRO_NAMES:
            raise MacroError(f"fused_in_proj of {len(s.left)} parts over {shards} shards "
                             f"makes more than {MAX_MACRO_NAMES} pieces", span)
        prefix = self.fresh.prefix("fused_in_proj_tmp")
        pieces = [[f"{prefix}P{i}_{r}" for r in range(shards)] for i in range(len(s.left))]
        return [*(self._make(s, "fused_in_proj", [whole], names, axis, span)
                  for whole, names in zip(s.left, pieces)),
                self._make(s, "fused_in_proj", [pieces[i][r] for r in range(shards)
                                                for i in range(len(s.left))],
                           [s.right[0]], axis, span)]

    def _probe_count(self, written: Statement, s: Statement) -> int:
        """Shards of the destination key `tp_probe_key` names; without one, of the
        statement's own destination. A key with no shard information counts 1, as in
        PaddleFormers."""
        probe = s.attribute("tp_probe_key")
        if probe is None:
            return self._count(written, written.right[0])
        if not isinstance(probe.value, str):
            raise MacroError(f"tp_probe_key names a key, not {probe.value!r}", probe.span)
        count, counts = shard_count(self.ctx.destination, probe.value)
        if count is None and counts:
            raise MacroError(f"the shard counts of '{probe.value}' and its optimizer states "
                             f"differ ({counts})", probe.span)
        return count or 1

def run(chained: ChainedProgram, ctx: CompileContext) -> Program:
    program = chained.program
    fuser = _Fuser(ctx, chained.chains, FreshNames(program, ctx))
    return Program(tuple(out for index, statement in enumerate(program.statements)
                         for out in fuser.expand(index, statement)), program.shared)
