"""Ask PaddlePaddle 3.3.1's AOA engine what it answers for one case.

This is a tool for the team, not part of aoa: it runs ONLY under a Python that has
``paddlepaddle==3.3.1`` installed, which aoa never depends on (see bench/README.md for the
separate virtual environment)::

    /work/paddle-venv/bin/python bench/paddle_reference.py CASE.json [--compare] [--indent N]

``CASE.json`` has the format of ``examples/<name>/case.json`` (only ``aoa_statements``,
``reverse``, ``source``, ``destination`` and ``queries`` are read; a folder holding a
``case.json`` is accepted too). The script builds one engine, asks every query in order and
prints, as JSON, what Paddle did in the form of the examples' ``expect``::

    {"status": "ok" | "error",
     "paddle_error": "<ExceptionType>: <message>",      # errors only
     "entries": [[{"target", "source", "postprocess"}, ...] | null, ...]}   # one per query

A query Paddle never answered (the constructor or an earlier query raised) is ``null``.
With ``--compare`` the answer is checked against the file's own ``expect`` (status,
``paddle_error`` and ``entries``, exactly) and the exit status is 1 on a difference.
Everything Paddle prints itself (its "AOA Traceback", warnings) goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

try:
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc
except ImportError as exc:  # pragma: no cover - depends on the interpreter
    sys.exit(
        f"paddle_reference.py needs paddlepaddle==3.3.1 ({exc}); run it with the Paddle "
        "virtual environment's python, e.g. /work/paddle-venv/bin/python (bench/README.md)"
    )


def to_desc(shard: dict[str, Any]) -> ShardedWeightDesc:
    """A case.json shard object as Paddle's ShardedWeightDesc (tuples, as the loaders make)."""
    return ShardedWeightDesc(
        key=shard["key"],
        local_shape=tuple(shard["local_shape"]),
        global_shape=tuple(shard["global_shape"]),
        global_offset=tuple(shard["global_offset"]),
        dtype=shard.get("dtype"),
    )


def to_shard_info(layout: dict[str, list[dict[str, Any]]] | None):
    if layout is None:
        return None
    return {key: [to_desc(s) for s in shards] for key, shards in layout.items()}


def from_desc(desc: ShardedWeightDesc) -> dict[str, Any]:
    return {
        "key": desc.key,
        "local_shape": list(desc.local_shape),
        "global_shape": list(desc.global_shape),
        "global_offset": list(desc.global_offset),
        "dtype": desc.dtype,
    }


def from_entry(entry) -> dict[str, Any]:
    pp = entry.postprocess_list
    return {
        "target": from_desc(entry.target_slice),
        "source": from_desc(entry.source_slice),
        "postprocess": None if pp is None else list(pp),
    }


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def ask_paddle(case: dict[str, Any]) -> dict[str, Any]:
    """Build one engine for the case and answer its queries in order."""
    queries = case.get("queries") or []
    entries: list[Any] = [None] * len(queries)
    answer: dict[str, Any] = {"status": "ok"}
    # Paddle prints its AOA traceback with print(); keep stdout for our JSON.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            engine = AOAEngine(
                aoa_config={
                    "aoa_statements": list(case.get("aoa_statements") or []),
                    "aoa_config_reverse": bool(case.get("reverse", False)),
                },
                source_state_shard_info=to_shard_info(case["source"]),
                destination_state_shard_info=to_shard_info(case.get("destination")),
            )
            for i, query in enumerate(queries):
                entries[i] = [from_entry(e) for e in engine.find_shard_sources(to_desc(query))]
        except Exception as exc:
            answer = {"status": "error", "paddle_error": describe_error(exc)}
    answer["entries"] = entries
    return answer


def compare(answer: dict[str, Any], expect: dict[str, Any]) -> list[str]:
    """Differences between Paddle's answer now and the case's recorded ``expect``."""
    problems = []
    if answer["status"] != expect.get("status"):
        problems.append(f"status: got {answer['status']!r}, expected {expect.get('status')!r}")
    if answer.get("paddle_error") != expect.get("paddle_error"):
        problems.append(
            f"paddle_error: got {answer.get('paddle_error')!r}, "
            f"expected {expect.get('paddle_error')!r}"
        )
    got, want = answer["entries"], expect.get("entries")
    if got != want:
        if want is None or len(got) != len(want):
            problems.append(f"entries: got {len(got)} answers, expected {want and len(want)}")
        else:
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                if g != w:
                    problems.append(f"entries[{i}] differ: got {g}, expected {w}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", type=Path, help="a case.json file, or a folder holding one")
    parser.add_argument(
        "--compare", action="store_true", help="check the answer against the case's `expect`"
    )
    parser.add_argument("--indent", type=int, default=1, help="JSON indentation (default 1)")
    args = parser.parse_args(argv)

    path = args.case / "case.json" if args.case.is_dir() else args.case
    case = json.loads(path.read_text())
    answer = ask_paddle(case)
    print(json.dumps(answer, indent=args.indent))
    if not args.compare:
        return 0
    problems = compare(answer, case.get("expect") or {})
    for p in problems:
        print(f"{path}: {p}", file=sys.stderr)
    print(f"{path}: {'DIFFERS' if problems else 'matches expect'}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
