"""The copy kernel of this checkout against another build of it, call for call in one run.

    python bench/kernel_versions.py OTHER/_core.cpython-311-x86_64-linux-gnu.so
    python bench/kernel_versions.py OTHER_CORE.so --size 4096 --repeats 10

For a change to the kernel that should not change its speed: build the version before the
change somewhere else (`cmake -S . -B /tmp/before/build` in a checkout of it) and pass its
`_core` here. Both modules run the same tables on the same buffers, alternating, the order
flipped every repeat so that neither always runs on a warm cache; each line prints the
medians and their ratio (this one's time over the other's: above 1, this one is slower).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import ml_dtypes
import numpy as np

from aoa import _core
from aoa.runtime.copies import Copy, c_strides
from aoa.runtime.cpp_backend import pack


def load_other(path: str):
    spec = importlib.util.spec_from_file_location("_core", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", help="the other build's _core extension module")
    parser.add_argument("--size", type=int, default=8192, help="side of the square tensors")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    other, n = load_other(args.other), args.size
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((n, n), dtype=np.float32)
    bf16 = f32.astype(ml_dtypes.bfloat16)
    f32_out = np.ones((n, n), np.float32)  # touched now, so no page faults are timed
    bf16_out = np.ones((n, n), ml_dtypes.bfloat16)
    cases = {
        "contiguous slice, float32": (
            [Copy(0, n // 4 * n * 4, (n * 4, 4), 0, 0, (n * 4, 4), (n // 2, n), "float32",
                  "float32")], f32, f32_out[: n // 2]),
        "transpose, float32": (
            [Copy(0, 0, (4, n * 4), 0, 0, c_strides((n, n), 4), (n, n), "float32",
                  "float32")], f32, f32_out),
        "transpose, bfloat16": (
            [Copy(0, 0, (2, n * 2), 0, 0, c_strides((n, n), 2), (n, n), "bfloat16",
                  "bfloat16")], bf16, bf16_out),
        "cast bfloat16 -> float32": (
            [Copy(0, 0, (n * 2, 2), 0, 0, (n * 4, 4), (n, n), "bfloat16", "float32")],
            bf16, f32_out),
        "4096 copies of 4 kB": (
            [Copy(0, k * 4096, (4,), 0, k * 4096, (4,), (1024,), "float32", "float32")
             for k in range(4096)], f32, f32_out),
    }
    print(f"{n} x {n}, median of {args.repeats}; ms: this build, the other, this / other")
    for threads in (1, 2):
        for name, (copies, source, out) in cases.items():
            table = pack(copies)
            times: dict[object, list[float]] = {_core: [], other: []}
            for module in times:
                module.execute_copies(table, [source], [out], threads)
            for repeat in range(args.repeats):
                for module in (_core, other) if repeat % 2 else (other, _core):
                    start = time.perf_counter()
                    module.execute_copies(table, [source], [out], threads)
                    times[module].append(time.perf_counter() - start)
            this, that = (statistics.median(times[m]) * 1e3 for m in (_core, other))
            print(f"{threads} thread{'s' if threads > 1 else ' '}  {name:<28} {this:8.1f} "
                  f"{that:8.1f} {this / that:6.2f}")


if __name__ == "__main__":
    main()
