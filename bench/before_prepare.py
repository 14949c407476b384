"""What `aoa convert --destination` does before it compiles: aoa imported, the mapping read,
the `--destination` read aside (`aoa.forked`) and the source opened, in a fresh process as
the command does it; wall seconds from the first import, and this process's CPU seconds
(its children's not counted: they run beside it, on the second core).

With ``--against PYTHON``, the same runs are made by another interpreter (another build of
aoa, such as main's virtual environment) in turn with this one, round by round, so that both
see the same machine; the medians are printed last.

Usage: python bench/before_prepare.py WORK [--repeats 8] [--against OTHER/bin/python]
(WORK: a `small_tensors.py` work folder: map.aoa, src-61x256, destination.json)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from in_turn import in_turn
from in_turn import parser as in_turn_parser


def measure(work: str) -> tuple[float, float]:
    """Wall and CPU seconds of the command's steps before `prepare`."""
    wall = time.perf_counter()
    from aoa import cli
    from aoa.mapping import read_mapping, shard_info_read_aside

    args = cli.build_parser().parse_args(
        ["convert", f"{work}/map.aoa", "--source", f"{work}/src-61x256",
         "--destination", f"{work}/destination.json", "--output", f"{work}/unused"])
    with shard_info_read_aside(args.destination, "destination") as read_destination:
        import aoa.jobs.convert  # noqa: F401 - as the command imports it here

        read_mapping(args.mapping)
        _, checkpoint = cli._source_then_destination(args, read_destination)
    wall = time.perf_counter() - wall
    checkpoint.close()
    return wall, time.process_time()


def main() -> None:
    parser = in_turn_parser(__doc__, "work", 8)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        import gc

        gc.disable()  # as the command runs
        print(*measure(args.work))
        return
    found: dict[str, list[tuple[float, float]]] = {}
    for repeat, name, line in in_turn(__file__, lambda _: [args.work, "--once"],
                                      args.repeats, args.against):
        wall, cpu = map(float, line.split())
        found.setdefault(name, []).append((wall, cpu))
        print(f"{repeat} {name:8s} {wall:.3f} s wall, {cpu:.3f} s CPU")
    for name, runs in found.items():
        print(f"median {name:8s} {statistics.median(w for w, _ in runs):.3f} s wall, "
              f"{statistics.median(c for _, c in runs):.3f} s CPU")


if __name__ == "__main__":
    main()
