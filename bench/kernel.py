"""The copy kernel against numpy and memcpy, measured side by side in one run.

    python bench/kernel.py                    # 8192 x 8192 tensors, 5 repeats
    python bench/kernel.py --size 4096 --repeats 3

Every line times the kernel and what it is compared with alternately, repeat by repeat,
and prints the medians and their ratio (the other's time over the kernel's: above 1 the
kernel is faster). The kernel runs on one thread unless the line says otherwise, so it
meets numpy, which has one, on equal terms; the last lines show 1 -> N thread scaling.
Targets: contiguous slice >= 0.9x np.copyto; transpose >= 10x numpy's copyto from a
transposed view and >= 0.5x memcpy of the same bytes. Needs about 1.5 GB at 8192.

The fp8 lines dequantize a float8_e4m3fn weight with one float32 scale per 128 x 128 block
into bfloat16 (DeepSeek-V3's weight_scale_inv), as stored and transposed, against the numpy
reference backend running the same copy (aoa.runtime.numpy_backend, the definition the
kernel is tested against); GB/s counts the bytes read and written.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import ml_dtypes
import numpy as np

from aoa.runtime import cpp_backend, numpy_backend
from aoa.runtime.copies import BlockScale, Copy
from aoa.runtime.copies import c_strides as contiguous


def side_by_side(
    kernel: Callable[[], None], other: Callable[[], None], repeats: int
) -> tuple[float, float]:
    """Median seconds of ``kernel`` and ``other``, timed alternately after one warm-up each."""
    kernel(), other()
    kernel_times, other_times = [], []
    for _ in range(repeats):
        for run, times in ((kernel, kernel_times), (other, other_times)):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return statistics.median(kernel_times), statistics.median(other_times)


def report(name: str, times: tuple[float, float], target: str = "") -> None:
    kernel, other = times
    print(f"{name:<58} {kernel * 1e3:9.1f} {other * 1e3:9.1f} {other / kernel:7.2f}x  {target}")


def run_kernel(copy: Copy, source: np.ndarray, destination: np.ndarray, threads: int):
    return lambda: cpp_backend.execute_copies([copy], [source], [destination], threads=threads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192, help="side of the square tensors")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="threads for the scaling lines")
    args = parser.parse_args()
    n, repeats, threads = args.size, args.repeats, args.threads

    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((n, n), dtype=np.float32)
    bf16 = f32.astype(ml_dtypes.bfloat16)
    f32_out = np.ones((n, n), np.float32)  # touched now, so no page faults are timed
    bf16_out = np.ones((n, n), ml_dtypes.bfloat16)

    print(f"{n} x {n}, median of {repeats}; times in ms")
    print(f"{'':<58} {'kernel':>9} {'other':>9} {'ratio':>8}")

    rows = slice(n // 4, 3 * n // 4)
    half = f32_out[: n // 2]
    slice_copy = Copy(0, rows.start * n * 4, (n * 4, 4), 0, 0, (n * 4, 4), (n // 2, n),
                      "float32", "float32")
    report("contiguous slice, float32, vs np.copyto",
           side_by_side(run_kernel(slice_copy, f32, half, 1),
                        lambda: np.copyto(half, f32[rows]), repeats), "target >= 0.9x")
    assert np.array_equal(half, f32[rows])

    transposes = {}
    for name, source, out in (("float32", f32, f32_out), ("bfloat16", bf16, bf16_out)):
        item = source.itemsize
        transposes[name] = (Copy(0, 0, (item, n * item), 0, 0, contiguous((n, n), item),
                                 (n, n), name, name), source, out)
        transpose = run_kernel(*transposes[name], 1)
        report(f"transpose, {name}, vs np.copyto(dst, src.T)",
               side_by_side(transpose, lambda s=source, o=out: np.copyto(o, s.T), repeats),
               "target >= 10x")
        assert np.array_equal(out, source.T)
        memcpy = lambda s=source, o=out: np.copyto(o, s)  # noqa: E731
        report(f"transpose, {name}, vs memcpy of the same bytes",
               side_by_side(transpose, memcpy, repeats), "target >= 0.5x")
        report(f"transpose, {name}, {threads} threads, vs memcpy of the same bytes",
               side_by_side(run_kernel(*transposes[name], threads), memcpy, repeats))

    cast = Copy(0, 0, (n * 2, 2), 0, 0, (n * 4, 4), (n, n), "bfloat16", "float32")
    report("cast bfloat16 -> float32, vs numpy astype into place",
           side_by_side(run_kernel(cast, bf16, f32_out, 1),
                        lambda: np.copyto(f32_out, bf16, casting="unsafe"), repeats))
    assert np.array_equal(f32_out, bf16.astype(np.float32))

    fp8 = rng.integers(0, 256, (n, n), dtype=np.uint8)
    fp8[(fp8 & 0x7F) == 0x7F] = 0  # no NaN
    grid = -(-n // 128)
    scales = rng.uniform(0.01, 2, (grid, grid)).astype(np.float32)
    dequantized = {}
    for name, order in (("as stored", (0, 1)), ("transposed", (1, 0))):
        block = BlockScale(1, 0, tuple(contiguous((grid, grid), 4)[a] for a in order),
                           (128, 128), (0, 0))
        copy = Copy(0, 0, tuple(contiguous((n, n), 1)[a] for a in order), 0, 0,
                    contiguous((n, n), 2), (n, n), "float8_e4m3fn", "bfloat16", (), block)
        dequantized[name] = (copy, [fp8, scales], bf16_out)
        reference = np.zeros_like(bf16_out)
        times = side_by_side(
            lambda c=copy: cpp_backend.execute_copies([c], [fp8, scales], [bf16_out],
                                                   threads=1),
            lambda c=copy, r=reference: numpy_backend.execute_copies([c], [fp8, scales], [r]),
            repeats)
        moved = n * n * 3 + scales.nbytes
        report(f"dequantize fp8 -> bfloat16 {name}, vs the numpy reference", times,
               f"{moved / times[0] / 1e9:.2f} vs {moved / times[1] / 1e9:.2f} GB/s")
        assert bf16_out.tobytes() == reference.tobytes()

    print(f"scaling: the kernel on {threads} threads (kernel column) against 1 (other column)")
    scaled = {
        "contiguous slice, float32": (slice_copy, f32, half),
        "transpose, float32": transposes["float32"],
        "transpose, bfloat16": transposes["bfloat16"],
        "cast bfloat16 -> float32": (cast, bf16, f32_out),
    }
    for name, (copy, source, out) in scaled.items():
        one, many = side_by_side(run_kernel(copy, source, out, 1),
                                 run_kernel(copy, source, out, threads), repeats)
        report(f"{name}, 1 -> {threads} threads (speed-up)", (many, one))
    for name, (copy, sources, out) in dequantized.items():
        one, many = side_by_side(
            lambda c=copy, s=sources, o=out: cpp_backend.execute_copies([c], s, [o], threads=1),
            lambda c=copy, s=sources, o=out: cpp_backend.execute_copies([c], s, [o],
                                                                        threads=threads),
            repeats)
        moved = n * n * 3 + scales.nbytes
        report(f"dequantize fp8 {name}, 1 -> {threads} threads (speed-up)", (many, one),
               f"{moved / many / 1e9:.2f} GB/s on {threads}")


if __name__ == "__main__":
    main()
