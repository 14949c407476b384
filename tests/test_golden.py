"""Golden files: the printed IR after each pass, and the exact text of error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from golden_support import compare, load

from aoa.errors import AoaError
from aoa.pipeline import analyze

GOLDEN = Path(__file__).parent / "golden"
PASS_CASES = sorted((GOLDEN / "passes").glob("*.aoa"))
ERROR_CASES = sorted((GOLDEN / "errors").glob("*.aoa"))


def printed_passes(path: Path) -> str:
    text, source, destination, reverse = load(path)
    out: list[str] = []

    def after(name, program, ctx, seconds):
        if name in ("expand_macros", "expand_fused"):
            out.append(f"== {name}")
            out.extend(str(s) for s in program.statements)

    compilation = analyze(text, source, destination, reverse=reverse, file=path.name,
                          after_pass=after)
    out.append("== outputs")
    for key, tensor in compilation.tensors.outputs.items():
        if tensor is None:
            out.append(f"{key}: empty")
            continue
        out.append(f"{key}: {list(tensor.shape)} {tensor.dtype}")
        for source_key, piece in tensor.pieces():
            target = ", ".join(f"{a}:{b}" for a, b in zip(piece.target_lo, piece.target_hi))
            region = ", ".join(f"{a}:{b}" for a, b in zip(piece.source_lo, piece.source_hi))
            ops = " ".join(getattr(op, "text", op) for op in piece.ops)
            out.append(f"    [{target}] <- {source_key}[{region}] {ops}".rstrip())
    out.append("== notes")
    compilation.plan()
    out.extend(note.render() for note in compilation.ctx.notes)
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("path", PASS_CASES, ids=lambda p: p.stem)
def test_pass_output(path):
    compare(path, printed_passes(path))


@pytest.mark.parametrize("path", ERROR_CASES, ids=lambda p: p.stem)
def test_error_message(path):
    text, source, destination, reverse = load(path)
    with pytest.raises(AoaError) as raised:
        analyze(text, source, destination, reverse=reverse, file=path.name).plan()
    compare(path, f"{type(raised.value).__name__}\n{raised.value.render()}\n")
