"""Reading a cold file into the page cache by several ``sendfile`` streams at once, beside
``dd iflag=direct``: how many reads `aoa.storage.read_ahead` keeps in flight (STREAMS) and
how large each is (CHUNK_BYTES).

Each configuration ``NxM`` reads the whole file with N threads, each taking the next M MiB
chunk in turn and sending it into /dev/null (as the read-ahead does, without its window);
``dd`` is `dd if=FILE of=/dev/null bs=16M iflag=direct` (the yardstick of bench/convert.py
--cold). The file is dropped from the page cache (posix_fadvise DONTNEED) before each read,
and the configurations alternate within each repeat, since this VM's disk swings by 2x in a
minute. GB/s per repeat, then the medians.

Usage: python bench/read_streams.py FILE [--repeats 5] [--configs dd,1x8,4x8,4x16,8x16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def dd(path: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"],
                   check=True, capture_output=True)
    return time.perf_counter() - start


def streams(path: Path, count: int, chunk: int) -> float:
    """Seconds to read ``path`` by ``count`` threads taking ``chunk`` bytes at a time."""
    size = path.stat().st_size
    next_chunk = iter(range(0, size, chunk))
    lock = threading.Lock()

    def stream() -> None:
        fd = os.open(path, os.O_RDONLY)
        sink = os.open(os.devnull, os.O_WRONLY)
        try:
            while True:
                with lock:
                    start = next(next_chunk, None)
                if start is None:
                    return
                end = min(start + chunk, size)
                while start < end:
                    sent = os.sendfile(sink, fd, start, end - start)
                    if sent <= 0:
                        return
                    start += sent
        finally:
            os.close(fd)
            os.close(sink)

    threads = [threading.Thread(target=stream) for _ in range(count)]
    begin = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--configs", default="dd,1x8,4x8,4x16,8x16")
    args = parser.parse_args()
    configs = args.configs.split(",")
    size = args.file.stat().st_size
    rates: dict[str, list[float]] = {config: [] for config in configs}
    for _ in range(args.repeats):
        for config in configs:
            drop(args.file)
            if config == "dd":
                seconds = dd(args.file)
            else:
                count, mib = (int(part) for part in config.split("x"))
                seconds = streams(args.file, count, mib << 20)
            rates[config].append(size / seconds / 1e9)
    print(f"reading {size / 1e9:.2f} GB cold, GB/s per repeat (median)")
    for config, found in rates.items():
        print(f"{config:>6s}  {' '.join(f'{rate:5.2f}' for rate in found)}"
              f"  ({statistics.median(found):.2f})")


if __name__ == "__main__":
    main()
