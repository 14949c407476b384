"""The in-process conversion of small_tensors.py split into its phases: open the source,
prepare (compile, plan, files), execute (lay out, fill, write, fsync); wall and CPU seconds
of each, and the main thread's CPU seconds of execute (what the write waits for on an idle
machine: the next file is laid out on a thread of its own while this one is filled).

With ``--against PYTHON``, the same runs are made by another interpreter (another build of
aoa, such as a virtual environment of an older commit) in turn with this one, round by
round, each in a fresh process, so that both see the same machine. The collector is
stopped, as in the command (`aoa.cli.main`).

Usage: python bench/convert_phases.py WORK [--repeats 3] [--against OTHER/bin/python]
(WORK: small_tensors.py's work folder, holding map.aoa, destination.json and src-61x256;
the output goes to WORK/out-phases-N, N the interpreter's place)
"""

from __future__ import annotations

import argparse
import gc
import itertools
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from in_turn import in_turn
from in_turn import parser as in_turn_parser


def measure(work: Path, output: Path) -> str:
    """One conversion, as a line of phases."""
    gc.disable()
    from aoa.jobs.convert import execute, prepare
    from aoa.mapping import read_mapping, read_shard_info
    from aoa.storage import open_source

    mapping = read_mapping(str(work / "map.aoa"))
    destination = read_shard_info(str(work / "destination.json"), "destination")
    shutil.rmtree(output, ignore_errors=True)
    marks = [(time.perf_counter(), time.process_time())]
    with open_source(work / "src-61x256") as checkpoint:
        marks.append((time.perf_counter(), time.process_time()))
        conversion = prepare(mapping, checkpoint, destination=destination)
        marks.append((time.perf_counter(), time.process_time()))
        main = time.thread_time()
        execute(conversion, output)
        main = time.thread_time() - main
        marks.append((time.perf_counter(), time.process_time()))
    (open_wall, open_cpu), (prepare_wall, prepare_cpu), (execute_wall, execute_cpu) = (
        (b[0] - a[0], b[1] - a[1]) for a, b in itertools.pairwise(marks))
    total = marks[-1][0] - marks[0][0]
    compiled = conversion.job.compile_seconds
    return (f"open {open_wall:.3f}/{open_cpu:.3f}  prepare {prepare_wall:.3f}/{prepare_cpu:.3f}"
            f" (compile {compiled:.3f})  execute {execute_wall:.3f}/{execute_cpu:.3f}, main "
            f"thread {main:.3f}  total {total:.3f}  total/compile {total / compiled:.2f}")


def main() -> None:
    parser = in_turn_parser(__doc__, "work", 3)
    parser.add_argument("--output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work)
    if args.output is not None:
        print(measure(work, args.output))
        return
    print("seconds: wall/CPU of this process; main thread: CPU of execute's own thread")
    for repeat, name, line in in_turn(
            __file__, lambda place: [str(work), "--output",
                                     str(work / f"out-phases-{place}")],
            args.repeats, args.against):
        print(f"{repeat} {name:8s} {line}")


if __name__ == "__main__":
    main()
