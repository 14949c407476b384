"""Direct writes at several queue depths, side by side: does the disk write faster with more
of them in flight than the staging writer's two (aoa.storage.writer: WRITERS buffers of
BUFFER_BYTES written at once)?

Each configuration writes the same file (reserved with posix_fallocate, as the writer does)
with ``O_DIRECT`` from page-aligned buffers: IN_FLIGHT buffers of 32 MiB written at once,
each as PARTS concurrent pwrites (so IN_FLIGHT x PARTS threads), then fsyncs it. The
buffers are the writer's (`aoa.storage.writer._buffer`: huge pages where the system gives
them); suffix ``s``: shared anonymous memory in 4 KiB pages (the writer before), ``p``:
private memory in 4 KiB pages. The
configurations alternate within each repeat, since this VM's disk swings by 2x in a minute;
medians and spreads at the end. ``dd`` is `dd if=/dev/zero bs=16M oflag=direct` into a new
file (the reference of bench/convert.py); suffix ``nf``: without reserving first.

Usage: python bench/direct_writes.py [--gb 1.55] [--repeats 6] [--work DIR]
       [--configs dd,2x1,2x1s,2x4,4x1,1x1,2x1nf]
"""

from __future__ import annotations

import argparse
import mmap
import os
import queue
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from aoa.storage.writer import _buffer

BUFFER_BYTES = 32 << 20


def dd(path: Path, total: int) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=16M", "iflag=count_bytes",
                    f"count={total}", "oflag=direct"], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def write(path: Path, total: int, config: str) -> float:
    """Seconds to write ``total`` bytes to ``path`` as ``config`` says, fsync included."""
    if config == "dd":
        return dd(path, total)
    pages = config[-1] if config[-1] in "sp" else ""
    reserve = not config.removesuffix(pages).endswith("nf")
    in_flight, parts = map(int, config.removesuffix(pages).removesuffix("nf").split("x"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        if reserve:
            os.posix_fallocate(fd, 0, total)
        piece = BUFFER_BYTES // parts
        offsets: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        for offset in range(0, total, piece):
            offsets.put(offset)
        threads = in_flight * parts
        for _ in range(threads):
            offsets.put(None)

        def writer() -> None:
            buffer = {"s": lambda: mmap.mmap(-1, piece),
                      "p": lambda: mmap.mmap(-1, piece, flags=mmap.MAP_PRIVATE
                                             | mmap.MAP_ANONYMOUS),
                      "": lambda: _buffer(piece)}[pages]()
            buffer[:] = b"\1" * piece
            while (offset := offsets.get()) is not None:
                os.pwrite(fd, memoryview(buffer)[:min(piece, total - offset)], offset)

        start = time.perf_counter()
        workers = [threading.Thread(target=writer) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.55)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--work", help="folder on the file system to test (default: /tmp)")
    parser.add_argument("--configs", default="dd,2x1,2x1s,2x1p,2x4,4x1,1x1",
                        help="dd or IN_FLIGHTxPARTS[nf][s|p], comma-separated (2x1: the "
                             "writer today; nf: no posix_fallocate first; s, p: 4 KiB "
                             "pages, shared or private)")
    args = parser.parse_args()
    total = int(args.gb * 1e9) // (1 << 20) * (1 << 20)
    configs = args.configs.split(",")
    seconds: dict[str, list[float]] = {c: [] for c in configs}
    folder = Path(args.work or tempfile.gettempdir())
    path = folder / f"aoa-direct-writes-{os.getpid()}.out"
    for repeat in range(args.repeats):
        for config in configs:
            seconds[config].append(write(path, total, config))
        print(f"repeat {repeat + 1}: " + "  ".join(
            f"{c} {s[-1]:.2f} s" for c, s in seconds.items()), flush=True)
    print(f"{total / 1e9:.2f} GB with O_DIRECT, {args.repeats} repeats")
    print(f"{'in flight x parts':>18s}{'median s':>10s}{'min':>7s}{'max':>7s}{'GB/s':>7s}")
    for config, values in seconds.items():
        median = statistics.median(values)
        print(f"{config:>18s}{median:10.2f}{min(values):7.2f}{max(values):7.2f}"
              f"{total / median / 1e9:7.2f}")


if __name__ == "__main__":
    main()
