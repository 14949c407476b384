"""One measurement of a bench script made in fresh processes, round by round: this
interpreter's aoa, then, with ``--against PYTHON``, another's (another build, such as a
virtual environment of an older commit), so that both see the same machine."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence


def parser(doc: str, work: str, repeats: int) -> argparse.ArgumentParser:
    """The options such a script takes: its ``work`` (a folder), ``--repeats`` (default
    ``repeats``) and ``--against``; it adds the hidden one its single measurement runs by."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(work)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--against", help="another Python whose aoa to time in turn")
    return parser


def in_turn(script: str, arguments: Callable[[int], Sequence[str]], repeats: int,
            against: str | None) -> Iterator[tuple[int, str, str]]:
    """``script`` run with ``arguments(place)`` (place 0: this Python, 1: ``against``),
    ``repeats`` rounds: each run's round, name ("this", "against") and output, stripped."""
    pythons = [("this", sys.executable)] + ([("against", against)] if against else [])
    for repeat in range(1, repeats + 1):
        for place, (name, python) in enumerate(pythons):
            yield repeat, name, subprocess.run([python, script, *arguments(place)], check=True,
                                               capture_output=True, text=True).stdout.strip()
