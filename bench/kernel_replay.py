"""The kernel calls of one small_tensors.py conversion, replayed: this checkout's `_core`
against another build's, call for call, in one process.

    python bench/kernel_replay.py WORK --against OTHER/_core.cpython-311-x86_64-linux-gnu.so

WORK is small_tensors.py's work folder (map.aoa, destination.json, src-61x256). The
conversion runs once (into WORK/out-replay), its `_core.execute_copies` calls (tables,
source buffers and windows) are kept, and then run again on one thread into buffers of
the same sizes, warm, by each `_core` in turn (the order flipped every round); each line
prints the best CPU time of the rounds. What it isolates: reading and checking the
records and moving the bytes, without the page faults of fresh staging buffers and
source pages. For instruction counts, run it under callgrind with ``--rounds 1``.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from kernel_versions import load_other  # another build's _core, as that bench loads it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--against", help="another build's _core extension module")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per _core")
    parser.add_argument("--repeats", type=int, default=10, help="replays per round")
    args = parser.parse_args()
    gc.disable()

    import aoa.runtime.cpp_backend as cpp_backend
    from aoa.jobs.convert import execute, prepare
    from aoa.mapping import read_mapping, read_shard_info
    from aoa.storage.formats import open_source

    core = cpp_backend._core
    calls = []

    class Recording:
        def __getattr__(self, name: str) -> object:
            return getattr(core, name)

        @staticmethod
        def execute_copies(table, sources, destinations, threads, windows, source_windows):
            calls.append((table.copy(), list(sources),
                          [bytearray(len(memoryview(d))) for d in destinations],
                          None if windows is None else windows.copy(),
                          None if source_windows is None else source_windows.copy()))
            core.execute_copies(table, sources, destinations, threads, windows,
                                source_windows)

    work, output = args.work, args.work / "out-replay"
    mapping = read_mapping(work / "map.aoa")
    destination = read_shard_info(work / "destination.json", "destination")
    with open_source(work / "src-61x256") as source:
        conversion = prepare(mapping, source, destination=destination)
        shutil.rmtree(output, ignore_errors=True)
        cpp_backend._core = Recording()  # type: ignore[assignment]
        try:
            execute(conversion, output)
        finally:
            cpp_backend._core = core
        shutil.rmtree(output, ignore_errors=True)
        cores = {"this": core}
        if args.against:
            cores["against"] = load_other(args.against)
        fields = sum(len(call[0]) for call in calls)
        print(f"{len(calls)} calls, {fields:,} table fields")
        best = {name: float("inf") for name in cores}
        for round_ in range(args.rounds):
            names = list(cores) if round_ % 2 == 0 else list(reversed(cores))
            for name in names:
                run = cores[name].execute_copies
                for table, sources, destinations, windows, source_windows in calls:
                    run(table, sources, destinations, 1, windows, source_windows)  # warm
                for _ in range(args.repeats):
                    start = time.process_time()
                    for table, sources, destinations, windows, source_windows in calls:
                        run(table, sources, destinations, 1, windows, source_windows)
                    best[name] = min(best[name], time.process_time() - start)
        for name, seconds in best.items():
            print(f"{name:8s} best CPU {seconds * 1e3:.1f} ms")
        if "against" in best:
            print(f"this / against: {best['this'] / best['against']:.2f}")


if __name__ == "__main__":
    main()
