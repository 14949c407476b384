"""Golden fixtures, one file per pass: what the pipeline leaves after that pass, printed, or
the exact text of the error it raises (golden_support.py says how a file reads)."""

from __future__ import annotations

from pathlib import Path

import pytest
from golden_support import Case, compare, read_cases

from aoa.errors import AoaError
from aoa.passes import PIPELINE, through
from aoa.passes.parse import texts
from aoa.pipeline import new_context, run_passes
from aoa.printer import to_text

FIXTURES = Path(__file__).parent / "golden" / "passes"
PASSES = {p.NAME: p for p in PIPELINE}
CASES = [(path, case) for path in sorted(FIXTURES.glob("*.txt")) for case in read_cases(path)]


def test_every_pass_has_a_fixture_file():
    assert sorted(path.stem for path in FIXTURES.glob("*.txt")) == sorted(PASSES)


@pytest.mark.parametrize("path, case", CASES, ids=[f"{p.stem}:{c.name}" for p, c in CASES])
def test_after_pass(path: Path, case: Case):
    source, destination, reverse = case.config()
    try:
        strict, fused = case.strictness()
        ctx = new_context(source, destination, reverse, strict=strict, fused=fused)
        ir = run_passes(texts(case.mapping, file=case.file), ctx,
                        through(PASSES[path.stem]))
        printed = to_text(ir)
    except AoaError as error:
        printed = f"{type(error).__name__}\n{error.render()}"
    compare(path, case, printed)
