"""Check the mapping: what Paddle runs but a person almost surely did not mean, refused in
strict mode and noted otherwise (`CompileContext.mistake`).

* A source key that no statement mentions reaches the output under its own name while
  other statements rename keys: a forgotten statement (Paddle passes the key on as it is,
  under a name the target does not use). A mapping that renames nothing, a pure reshard,
  passes keys on by design.
* A tensor the source's record says is stored fused by its shard count (`fused_ffn`,
  `fused_qkv_old`, `fused_in_proj`: `[gate_r | up_r]` on each rank r) reaches a
  destination over another shard count through no statement of its macro: copied as it
  lies, its halves or heads land on the wrong ranks.

A statement that expands to nothing, a `fused_qkv` group split between ranks and a name
written over before anything read it are caught where they are made (expand_macros.py,
expand_fused.py, propagate_shapes.py).
"""

from __future__ import annotations

from collections.abc import Iterator

from aoa.errors import ValidationError
from aoa.ir import NOTHING, SHARD_COUNT_FLAGS, Program, Statement
from aoa.layout import distinct_boxes
from aoa.passes.context import CompileContext
from aoa.symbolic import SymbolicTensors

NAME = "check_mapping"


def run(tensors: SymbolicTensors, ctx: CompileContext) -> SymbolicTensors:
    _check_passed_on(tensors, ctx)
    if ctx.fused is not None:
        _check_fused(tensors, ctx)
    return tensors


def _statements(program: Program) -> Iterator[Statement]:
    """Every statement of the program, the instances share_instances set aside included."""
    yield from program.statements
    for group in program.shared:
        for follower in group.followers:
            yield follower.statement


def _moving(tensors: SymbolicTensors, ctx: CompileContext) -> Statement | None:
    """A statement that moves a source key: reads it, while the key does not reach the
    output under its own name (renamed, fused, split ...; not deleted with `X -> _`). A key
    read and also kept (`a -> b` with `a` a destination too: a copy, as for tied weights)
    is not moved."""
    source_keys, outputs, removed = ctx.source_keys, tensors.outputs, tensors.removed
    for statement in tensors.program.statements:
        for name in statement.right if ctx.reverse else statement.left:
            key = name.base
            if key in source_keys and key not in outputs and key not in removed:
                return statement
    for group in tensors.program.shared:
        for follower in group.followers:
            if any(key not in outputs and key not in removed for key in follower.reads):
                return follower.statement
    return None


def _check_passed_on(tensors: SymbolicTensors, ctx: CompileContext) -> None:
    source_keys = ctx.source_keys
    candidates = [key for key, tensor in tensors.outputs.items()
                  if tensor is not None and key in source_keys]
    if not candidates:
        return
    moving = _moving(tensors, ctx)
    if moving is None:
        return
    mentioned = {name.base for s in _statements(tensors.program)
                 for name in (*s.left, *s.right)}
    passed = sorted(key for key in candidates if key not in mentioned)
    if not passed:
        return
    if len(passed) == 1:
        what = (f"source key '{passed[0]}' reaches the output under its own name, but no "
                "statement mentions it, while statements rename other keys")
    else:
        shown = ", ".join(f"'{key}'" for key in passed[:5])
        more = f" and {len(passed) - 5} more" if len(passed) > 5 else ""
        what = (f"{len(passed)} source keys reach the output under their own names, but no "
                f"statement mentions them, while statements rename other keys: {shown}{more}")
    key = passed[0]
    ctx.mistake(ValidationError(
        what, None,
        related=[("keys are renamed here, for example", moving.written().span)],
        hint=f"Say what becomes of it: `{key} -> new.name`, `{key} -> {key}` to keep its "
             f"name, or `{key} -> {NOTHING}` to leave it out; --lenient (strict=False) passes "
             "unmentioned keys on, as Paddle does."))


def _check_fused(tensors: SymbolicTensors, ctx: CompileContext) -> None:
    record = ctx.fused
    assert record is not None
    fused = {key: found for key in ctx.source if (found := record.find(key)) is not None}
    if not fused:
        return
    relaid = _relaid_by_macro(tensors, ctx)
    readers: dict[str, list[str]] = {}
    for output, tensor in tensors.outputs.items():
        if tensor is not None:
            for key in tensor.keys:
                if key in fused:
                    readers.setdefault(key, []).append(output)
    for key, found in fused.items():
        if (key, found.macro) in relaid:
            continue
        stored = len(distinct_boxes(ctx.source[key]))
        for output in readers.get(key, ()):
            laid_out = ctx.destination.get(output) if ctx.destination is not None else None
            shards = len(distinct_boxes(laid_out)) if laid_out else 1
            if shards == stored:
                continue
            statement = found.statement(key)
            fix = (f"Re-lay it with its macro, e.g. `{statement}` (a template with $LAYER_ID "
                   "covers every layer)" if statement is not None else
                   f"{found.macro} cannot lay it out again: convert the folder back (--to hf) "
                   "and forward at the new degree")
            ctx.mistake(ValidationError(
                f"'{key}' is stored fused by {found.macro} over {stored} shards (as "
                f"{record.path} records), but reaches '{output}' over {shards} through no "
                f"{found.macro} statement: copied as it lies, its parts would land on the "
                "wrong ranks",
                hint=f"{fix}; --lenient (strict=False) copies it as it lies."))


def _relaid_by_macro(tensors: SymbolicTensors, ctx: CompileContext) -> set[tuple[str, str]]:
    """(source key, macro) for each source key whose data a per-shard fused macro reads."""
    parents: dict[int, tuple[str, Statement]] = {}
    for statement in tensors.program.statements:
        for macro, parent in statement.origins():
            if macro in SHARD_COUNT_FLAGS:
                if parent.origin is not None and parent.origin.macro == "transpose":
                    parent = parent.origin.statement  # the names as written, `w^T`
                parents[id(parent)] = (macro, parent)
                break
    relaid = set()
    bound = tensors.bound
    for macro, parent in parents.values():
        for name in parent.right if ctx.reverse else parent.left:
            tensor = bound.get(name.base)
            for key in (tensor.keys if tensor is not None else (name.base,)):
                relaid.add((key, macro))
    for group in tensors.program.shared:
        for follower in group.followers:
            for attribute in follower.statement.attributes:
                if attribute.key in SHARD_COUNT_FLAGS:
                    relaid.update((key, attribute.key) for key in follower.reads)
    return relaid
