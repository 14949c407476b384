"""Propagate shapes: run the statements over symbolic tensors (spec 6.1-6.6).

A symbolic tensor (symbolic.py) is an ordered list of pieces, each saying "this box of me is
that box of a source key, permuted and cast like so". Splits, concats, permutes, casts,
renames and aliases only move boxes around, so the whole program costs time in the number
of pieces, not in bytes. The result, every destination key's tensor (SymbolicTensors), is
what the plan pass reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from aoa import symbolic
from aoa.dtypes import CAST_TARGETS
from aoa.errors import ShapeError, ValidationError, quote
from aoa.ir import (
    FLAG_ATTRIBUTES,
    NOTHING,
    PER_SHARD_FLAGS,
    Attribute,
    Name,
    Program,
    SharedInstances,
    Statement,
)
from aoa.layout import split_optimizer_suffix
from aoa.limits import MAX_NUMBER_DIGITS, MAX_PIECES
from aoa.passes.context import CompileContext
from aoa.symbolic import InputTensors, Permute, SymbolicTensors, Tensor

NAME = "propagate_shapes"


def _error(cls, message: str, span, statement: Statement | None, hint: str | None = None):
    return cls(message, span, hint=hint,
               expanded_from=statement.expansion() if statement is not None else ())


def split(tensor: Tensor, axis: int, parts: int) -> list[Tensor]:
    tensor.uses += parts
    return [Tensor(piece_map, tensor.keys, tensor.dtype)
            for piece_map in symbolic.split(tensor.piece_map, axis, parts)]


def concat(tensors: Sequence[Tensor], axis: int, dtype: str | None) -> Tensor:
    """``tensors`` joined along ``axis``, recorded as ``dtype`` (`_Machine.check_concat`)."""
    offsets: list[int] = []
    keys: list[str] = []
    for tensor in tensors:
        offsets.append(len(keys))
        keys += tensor.keys
        tensor.uses += 1
    return Tensor(symbolic.concat([t.piece_map for t in tensors], offsets, axis), tuple(keys),
                  dtype)


def transpose(tensor: Tensor, permute: Permute) -> Tensor:
    tensor.uses += 1
    return Tensor(symbolic.transpose(tensor.piece_map, permute), tensor.keys, tensor.dtype)


def cast(tensor: Tensor, dtype: str) -> Tensor:
    tensor.uses += 1
    return Tensor(symbolic.cast(tensor.piece_map, dtype), tensor.keys, tensor.dtype)


def identity(tensor: Tensor) -> Tensor:
    tensor.uses += 1
    return Tensor(tensor.piece_map, tensor.keys, tensor.dtype)


def _held_dtypes(tensor: Tensor) -> set[str | None]:
    """The dtypes the pieces of ``tensor`` are in: each one's last cast, else the dtype
    recorded (the source's: a concat records another only where every piece is cast)."""
    return {symbolic.dtype_after(piece.ops, tensor.dtype) for piece in tensor.piece_map.pieces}


def _described(tensor: Tensor, held: set[str | None]) -> str:
    """``tensor``'s dtype for a message: the one its pieces are in, as cast."""
    if held == {tensor.dtype}:
        return str(tensor.dtype)
    if len(held) == 1:
        return f"{tensor.dtype}, cast to {next(iter(held))}"
    return f"pieces in {' and '.join(sorted(map(str, held)))}"


_IDS = ("$LAYER_ID", "$EXPERT_ID")


def _lost(name: Name, earlier: Statement, statement: Statement) -> ValidationError:
    """The error for ``name``, written by ``statement`` over what ``earlier`` wrote."""
    where = earlier.span.location() if earlier.span is not None else "?"
    what = (f"'{earlier}' (expanded from the statement at {where})"
            if earlier.origin is not None else f"the statement at {where}")
    return _error(ValidationError, f"'{name.text}' is written again, but nothing read what "
                  f"{what} wrote to it: that result would be lost", name.span, statement,
                  hint="Give each result a name of its own (a template's target needs its "
                       "placeholder); to change a tensor, read it: `t -> t, dtype='float16'`.")


class _Machine:
    def __init__(self, program: Program, ctx: CompileContext) -> None:
        self.ctx = ctx
        self.reverse = ctx.reverse
        self.inputs = InputTensors(ctx.source)
        self.state = SymbolicTensors(program, self.inputs, {})
        self.bound = self.state.bound
        self.destination_keys = ctx.destination_keys
        #: the statement that last wrote each name
        self.writers: dict[str, Statement] = {}
        #: (permute= text, rank) -> the permutation it makes (a transpose per layer and
        #: matrix asks the same one, mostly `permute="[]"` of `^T`)
        self.permutes: dict[tuple[str, int], Permute] = {}

    def ref(self, name: Name, statement: Statement) -> Tensor:
        tensor = self.bound.get(name.text) or self.inputs.get(name.text)
        if tensor is None:
            hint = ("Check the spelling against the source keys, or assign it in an earlier "
                    "statement.")
            origin = statement.origin
            if origin is not None and origin.macro == "id" and all(
                    placeholder in str(origin.statement) for placeholder in _IDS):
                hint = ("A template with both placeholders takes every $LAYER_ID found with "
                        "every $EXPERT_ID found (spec 5.3, quirk Q8): where layers hold "
                        "different experts, write a template for each group of them.")
            raise _error(ShapeError, f"'{name.text}' is neither a source key nor assigned "
                         "before", name.span, statement, hint=hint)
        return tensor

    def bind(self, name: Name, tensor: Tensor, statement: Statement) -> None:
        lost = self.bound.get(name.text)
        if lost is not None and not lost.uses and lost is not tensor:
            self.check_lost(name, lost, statement)
        self.bound[name.text] = tensor
        self.writers[name.text] = statement
        if not tensor.name:
            tensor.name = name.text
        if name.text in self.destination_keys:
            self.state.outputs[name.text] = tensor
            self.state.writers[name.text] = statement

    def check_lost(self, name: Name, lost: Tensor, statement: Statement) -> None:
        """A name written again before anything read what was written to it: that result
        is lost (Paddle keeps the last write), most likely a name written twice by mistake,
        as a copied statement or a template whose target lacks its placeholder does. (The
        instances share_instances sets aside write keys written once in the program.)"""
        if sum(other is lost for other in self.bound.values()) > 1 or (
                lost.name in self.ctx.source_keys and self.inputs.get(lost.name) is lost):
            return  # (another name stands for it too, a source key's own: an alias keeps it)
        self.ctx.mistake(_lost(name, self.writers[name.text], statement))

    def axis(self, statement: Statement, tensor: Tensor, attributes: Sequence[Attribute]) -> int:
        if len(attributes) != 1 or attributes[0].key != "axis":
            given = ", ".join(f"{a.key}={a.value!r}" for a in attributes) or "none"
            at = attributes[1].span if len(attributes) > 1 else (
                attributes[0].span if attributes else statement.span)
            raise _error(ShapeError, "a split or concat takes exactly one attribute, axis=N "
                         f"(given: {given})", at, statement,
                         hint="Write `a -> b, c, axis=0`; casts and permutes go in statements "
                              "of their own.")
        return self.check_axis(attributes[0], tensor, statement)

    def check_axis(self, attribute: Attribute, tensor: Tensor, statement: Statement) -> int:
        value = attribute.value
        if not isinstance(value, int):
            raise _error(ShapeError, f"axis must be a number, not {value!r}", attribute.span,
                         statement)
        if value >= len(tensor.shape):
            raise _error(ShapeError, f"axis {value} is out of range for '{tensor.name}' of "
                         f"shape {list(tensor.shape)}", attribute.span, statement,
                         hint=f"Axes count from 0 to {len(tensor.shape) - 1}.")
        return value

    def run(self) -> SymbolicTensors:
        program = self.state.program
        statements = program.statements[::-1] if self.reverse else program.statements
        for statement in statements:
            self.execute(statement)
        return self.state

    def execute(self, statement: Statement) -> None:
        left, right = ((statement.right, statement.left) if self.reverse
                       else (statement.left, statement.right))
        attributes = statement.attributes
        if len(left) > 1 and len(right) > 1:
            raise _error(ShapeError, "a statement has several names on one side at most",
                         statement.span, statement,
                         hint="Split `a, b -> c, d` into a concat and a split.")
        if len(right) > 1:
            source = self.ref(left[0], statement)
            axis = self.axis(statement, source, attributes)
            if source.shape[axis] % len(right):
                origin = statement.origin
                if origin is not None and origin.macro in FLAG_ATTRIBUTES:
                    # a part the user named, cut into heads or per-shard pieces
                    (written,) = _as_written(origin.statement, left, self.reverse)
                    what = f"{origin.macro} cannot cut '{written}'"
                else:
                    what = f"cannot split '{left[0].text}'"
                raise _error(ShapeError, f"{what} of shape {list(source.shape)} into "
                             f"{len(right)} equal parts along axis {axis}", statement.span,
                             statement, hint=f"The size {source.shape[axis]} must be a "
                                             f"multiple of {len(right)}.")
            # a piece meets each part at most: counted only where that bound is too high
            if len(source.piece_map.pieces) * len(right) > MAX_PIECES:
                self.check_pieces(symbolic.split_pieces(source.piece_map, axis, len(right)),
                                  statement)
            for name, part in zip(right, split(source, axis, len(right))):
                self.bind(name, part, statement)
            return
        if len(left) > 1:
            tensors = [self.ref(name, statement) for name in left]
            axis = self.axis(statement, tensors[0], attributes)
            dtype = self.check_concat(statement, left, tensors, axis)
            if statement.origin is not None and statement.origin.macro in PER_SHARD_FLAGS:
                self.check_fused_pieces(statement, tensors, axis)
            self.check_pieces(sum(len(t.piece_map.pieces) for t in tensors), statement)
            self.bind(right[0], concat(tensors, axis, dtype), statement)
            return
        (source_name,), (target,) = left, right
        if target.text == NOTHING:
            self.state.removed[source_name.text] = statement
            return
        if source_name.text == NOTHING:
            self.state.added.add(target.text)
            return
        source = self.ref(source_name, statement)
        if not attributes:
            self.bind(target, identity(source), statement)
            return
        self.bind(target, self.unary(statement, source, attributes), statement)

    @staticmethod
    def check_pieces(count: int, statement: Statement) -> None:
        if count > MAX_PIECES:
            raise _error(ShapeError, f"the result would be made of {count} pieces of source "
                         f"tensors, more than {MAX_PIECES}", statement.span, statement,
                         hint="Each concat adds up the pieces of its inputs, and each split "
                              "cuts the pieces it crosses.")

    def check_concat(self, statement, names, tensors, axis) -> str | None:
        """Check that ``tensors`` join along ``axis``; the dtype their concat records.

        Tensors recorded in one dtype join as in Paddle, whatever their pieces are cast to:
        a later cast of the whole may make them one dtype (spec 6.2; the plan refuses a
        destination its pieces do not fill in its dtype). Where the recorded dtypes differ,
        Paddle raises, though its casts may have made the bytes one dtype (quirk Q28: a
        cast keeps the recorded dtype); aoa joins them when every piece is then in one
        dtype, and records that one (policy 0.2)."""
        first = tensors[0]
        expected = first.shape[:axis] + first.shape[axis + 1:]
        for name, tensor in zip(names[1:], tensors[1:]):
            shape = tensor.shape
            if shape[:axis] + shape[axis + 1:] != expected or len(shape) != len(first.shape):
                raise _error(ValidationError, f"cannot concatenate '{name.text}' of shape "
                             f"{list(tensor.shape)} with '{names[0].text}' of shape "
                             f"{list(first.shape)} along axis {axis}", name.span, statement,
                             hint="All dimensions but the concat axis must be equal.")
        if all(tensor.dtype == first.dtype for tensor in tensors):
            return first.dtype
        held = [_held_dtypes(tensor) for tensor in tensors]
        for name, tensor, dtypes in zip(names[1:], tensors[1:], held[1:]):
            if dtypes != held[0] or len(dtypes) > 1:
                raise _error(ShapeError, f"cannot concatenate '{name.text}' "
                             f"({_described(tensor, dtypes)}) with '{names[0].text}' "
                             f"({_described(first, held[0])}): the dtypes differ",
                             name.span, statement,
                             hint="Cast the tensors to one dtype after the concat.")
        (dtype,) = held[0]
        return dtype

    def check_fused_pieces(self, statement: Statement, pieces: Sequence[Tensor],
                           axis: int) -> None:
        """A per-shard fused layout is a row of equal pieces (whole heads, equal halves).
        Pieces cut from one tensor always are; pieces cut from the parts of a merge are
        only when the parts are in proportion, as a split by the same macro gives them.
        A forward merge over one shard joins the parts themselves: whatever their sizes,
        that is their plain concat (as in Paddle), which a note points out."""
        assert statement.origin is not None
        macro, expanded = statement.origin.macro, statement.origin.statement
        parts = expanded.right if self.reverse else expanded.left
        plain = statement.left == parts
        counts: tuple[int, ...] = (1, 1)
        rule = "halves of one size"
        if macro == "fused_qkv_old":
            heads, groups = (expanded.attribute(key) for key in ("num_heads",
                                                                 "num_key_value_groups"))
            assert heads is not None and groups is not None
            counts = (int(heads.value or 0), int(groups.value or 0), int(groups.value or 0))
            rule = ("whole heads of one size in the proportion num_heads : "
                    f"num_key_value_groups : num_key_value_groups = {' : '.join(map(str, counts))}")
        sizes = [piece.shape[axis] for piece in pieces]
        if not plain and len(set(sizes)) == 1:
            return
        if plain and all(size % n == 0 for size, n in zip(sizes, counts)) \
                and len({size // n for size, n in zip(sizes, counts)}) == 1:
            return
        names = _as_written(expanded, parts, self.reverse)
        shown = [f"'{name}' {list(self.ref(part, statement).shape)}"
                 for name, part in zip(names, parts)]
        described = ", ".join(shown[:-1]) + " and " + shown[-1]
        if plain:
            self.ctx.note(f"{macro} joins {described}, which along axis {axis} are not "
                          f"{rule}: over one shard that is their plain concat",
                          statement.span)
            return
        fused = (expanded.left if self.reverse else expanded.right)[0].text
        if self.reverse:
            hint = (f"Run forward, this statement cuts '{fused}' into {rule}, so no "
                    "forward run gives these shapes back; check the shapes.")
        else:
            hint = (f"{macro} lays the parts out shard by shard; for a plain concat write "
                    f"`{', '.join(names)} -> {fused}, axis={axis}`.")
        raise _error(ValidationError, f"{macro} cannot merge {described}: along axis {axis} "
                     f"they are not {rule}", statement.span, statement, hint=hint)

    def unary(self, statement: Statement, source: Tensor, attributes) -> Tensor:
        keys = [a.key for a in attributes]
        if len(attributes) == 2 and set(keys) == {"src_dtype", "dst_dtype"}:
            values = {a.key: a for a in attributes}
            for attribute in attributes:
                self.check_dtype(attribute, statement)
            chosen = values["src_dtype" if self.reverse else "dst_dtype"]
            return cast(source, chosen.value)
        if len(attributes) != 1:
            raise _error(ShapeError, "a one-to-one statement takes one attribute (or the pair "
                         f"src_dtype, dst_dtype), not {', '.join(keys)}", attributes[1].span,
                         statement, hint="Write each operation as a statement of its own.")
        (attribute,) = attributes
        if attribute.key in ("permute", "transpose"):
            if attribute.key == "transpose":
                self.ctx.note("'transpose=' is the older spelling of 'permute='",
                              attribute.span)
            return transpose(source, self.permutation(attribute, source, statement))
        if attribute.key == "dtype":
            if self.reverse:
                raise _error(ShapeError, "in reverse mode a cast must say both dtypes",
                             attribute.span, statement,
                             hint="Write src_dtype='...', dst_dtype='...' so the reverse "
                                  "run knows what to cast back to.")
            self.check_dtype(attribute, statement)
            return cast(source, attribute.value)
        if attribute.key == "axis":
            # Paddle never reads the axis of an alias, so no value of it is an error (0.1)
            self.ctx.note("a single name on each side with axis= is an alias: the right "
                          "name is the very same tensor (the axis is not used)",
                          attribute.span)
            return source
        if attribute.key == "src_dtype":
            raise _error(ShapeError, "src_dtype needs dst_dtype beside it", attribute.span,
                         statement, hint="Write src_dtype='...', dst_dtype='...'.")
        raise _error(ShapeError, f"unsupported attribute '{attribute.key}'", attribute.span,
                     statement, hint="A one-to-one statement takes permute=, dtype=, "
                                     "src_dtype= with dst_dtype=, or axis=.")

    def check_dtype(self, attribute: Attribute, statement: Statement) -> None:
        if attribute.value not in CAST_TARGETS:
            raise _error(ShapeError, f"cannot cast to {attribute.value!r}", attribute.span,
                         statement, hint="Casts go to one of " + ", ".join(CAST_TARGETS) + ".")

    def permutation(self, attribute: Attribute, source: Tensor, statement) -> Permute:
        rank = len(source.shape)
        text = str(attribute.value)
        permute = self.permutes.get((text, rank))
        if permute is None:
            permute = self.permutes[text, rank] = self._permutation(text, rank, source,
                                                                    attribute, statement)
        return permute

    def _permutation(self, text: str, rank: int, source: Tensor, attribute: Attribute,
                     statement: Statement) -> Permute:
        if text == "[]":
            axes = tuple(range(rank - 1, -1, -1))
            return Permute(axes, str(list(axes)))
        value = _axis_list(text)
        if value is None or sorted(value) != list(range(rank)):
            raise _error(ValidationError, f"permute={quote(text)} is not a permutation of the "
                         f"{rank} axes of '{source.name}' (shape {list(source.shape)})",
                         attribute.span, statement,
                         hint=f"List each axis 0..{rank - 1} once, e.g. "
                              f"'{list(range(rank))[::-1]}'.")
        axes = tuple(value)
        if self.reverse:
            inverse = [0] * rank
            for i, a in enumerate(axes):
                inverse[a] = i
            return Permute(tuple(inverse), str(inverse))
        return Permute(axes, text)


def _as_written(expanded: Statement, names: Sequence[Name], reverse: bool) -> list[str]:
    """``names`` of a statement a macro expanded, as the user wrote them: a transposed
    view made for `X^T` is shown as `X^T` (views keep the positions of their names)."""
    origin = expanded.origin
    if origin is None or origin.macro != "transpose":
        return [name.text for name in names]
    written = origin.statement
    side, written_side = ((expanded.right, written.right) if reverse
                          else (expanded.left, written.left))
    return [written_side[side.index(name)].text if name in side else name.text
            for name in names]


_AXIS = rf"\d{{1,{MAX_NUMBER_DIGITS}}}"
_AXIS_LIST = re.compile(rf"\[\s*(?:({_AXIS}(?:\s*,\s*{_AXIS})*)\s*,?)?\s*\]")


def _axis_list(text: str) -> list[int] | None:
    """The axes of `permute='[1, 0, 2]'` (a Python list of non-negative integers), or None.

    Read with a pattern rather than ast.literal_eval, which takes any literal: nested lists,
    strings, numbers of any size, with a RecursionError for a deep one."""
    match = _AXIS_LIST.fullmatch(text.strip())
    if match is None:
        return None
    return [int(axis) for axis in match.group(1).split(",")] if match.group(1) else []


def select_outputs(state: SymbolicTensors, ctx: CompileContext) -> None:
    """Which tensor each destination key gets (spec 6.6)."""
    outputs = state.outputs
    if ctx.destination is not None:
        selected: dict[str, Tensor | None] = {}
        for key in ctx.destination:
            model_key = split_optimizer_suffix(key)[0]
            if model_key in selected:
                continue
            if model_key in outputs:
                selected[model_key] = outputs[model_key]
            elif model_key in state.added:
                selected[model_key] = None
            elif model_key in state.inputs:
                selected[model_key] = identity(state.inputs[model_key])
            else:
                raise ValidationError(
                    f"destination key '{model_key}' is written by no statement, and the "
                    "source has no key of that name",
                    hint=f"Map a source key to it (`some.key -> {model_key}`), or declare it "
                         f"empty with `_ -> {model_key}`.")
        state.outputs = selected
        return
    # No destination: every tensor nobody consumed is an output, inputs first.
    selected = {name: Tensor(t.piece_map, t.keys, t.dtype, name=name)
                for name, t in state.inputs.items() if t.uses == 0 and name not in state.removed}
    taken = {state.inputs[name] for name in selected}  # an alias is the same tensor
    for name, tensor in state.bound.items():
        if tensor.uses == 0 and name not in selected and tensor not in taken:
            taken.add(tensor)
            selected[name] = Tensor(tensor.piece_map, tensor.keys, tensor.dtype, name=name)
    state.outputs = selected


def share_outputs(state: SymbolicTensors, shared: Sequence[SharedInstances],
                  ctx: CompileContext) -> None:
    """The destination keys of instances set aside by share_instances: the kept instance's
    tensors with the source keys renamed, read for read (the kept instance's slots and
    what they read are worked out once for all its followers)."""
    outputs, writers, destination_keys = state.outputs, state.writers, ctx.destination_keys
    for group in shared:
        kept = group.kept
        if len(kept.left) == 1 and len(kept.right) == 1:  # a rename (maybe a cast, a ^T)
            tensor = outputs.get(kept.right[0].text)
            if tensor is not None and tensor.keys == (kept.left[0].base,):
                for statement, own_reads in group.followers:
                    own_key = statement.right[0].text
                    if own_key in destination_keys:
                        outputs[own_key] = Tensor(tensor.piece_map, own_reads, tensor.dtype,
                                                  name=own_key)
                        writers[own_key] = statement
                continue
        reads = [n.base for n in kept.left]
        # (position of a write, its tensor, the read each slot of it comes from: a
        # position in the reads, or past them one in the key itself, kept as it is)
        pattern = [(j, tensor, [reads.index(k) if k in reads else len(reads) + slot
                                for slot, k in enumerate(tensor.keys)],
                    not set(tensor.keys) <= set(reads))
                   for j, name in enumerate(kept.right)
                   if (tensor := outputs.get(name.text)) is not None]
        for statement, own_reads in group.followers:
            for j, tensor, slots, foreign in pattern:
                own_key = statement.right[j].text
                if own_key in destination_keys:
                    names = own_reads + tensor.keys if foreign else own_reads
                    outputs[own_key] = Tensor(tensor.piece_map,
                                              tuple([names[i] for i in slots]), tensor.dtype,
                                              name=own_key)
                    writers[own_key] = statement


def run(program: Program, ctx: CompileContext) -> SymbolicTensors:
    tensors = _Machine(program, ctx).run()
    share_outputs(tensors, program.shared, ctx)
    select_outputs(tensors, ctx)
    return tensors
