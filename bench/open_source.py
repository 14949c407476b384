"""Opening a checkpoint: `aoa.storage.open_source` of a folder, timed (wall and this
process's CPU seconds, which the load of a shared machine moves far less), N times.

With ``--against PYTHON``, the same runs are made by another interpreter (another build of
aoa, such as a virtual environment of an older commit) in turn with this one, round by
round, so that both see the same machine.

Usage: python bench/open_source.py FOLDER [--repeats 3] [--against OTHER/bin/python]
(for the 61x256 MoE of small_tensors.py: FOLDER is its work folder's src-61x256)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from in_turn import in_turn
from in_turn import parser as in_turn_parser


def measure(folder: str) -> str:
    """One opening of ``folder``, as a line: wall and CPU seconds, keys and shards."""
    from aoa.storage import open_source

    wall, cpu = time.perf_counter(), time.process_time()
    with open_source(folder) as checkpoint:
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        shards = sum(map(len, checkpoint.shards.values()))
        return (f"open {wall:.3f} s wall, {cpu:.3f} s CPU "
                f"({len(checkpoint.shards):,} keys, {shards:,} shards)")


def main() -> None:
    parser = in_turn_parser(__doc__, "folder", 3)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.once:
        print(measure(args.folder))
        return
    # each in a fresh process, as a command would open it
    for repeat, name, line in in_turn(__file__, lambda _: [args.folder, "--once"],
                                      args.repeats, args.against):
        print(f"{repeat} {name:8s} {line}")


if __name__ == "__main__":
    main()
