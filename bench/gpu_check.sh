#!/usr/bin/env bash
# The GPU checks in one short run (a few minutes) on a machine with a CUDA GPU and CuPy:
#
#     bench/gpu_check.sh [GB]          # from anywhere; GB of the throughput checkpoint (4)
#
# 1. Installs into a private folder what the machine lacks, from wheels carried along in
#    $AOA_WHEELS (default .whl at the repository root; lark, say, which a CUDA image may
#    not have), then builds aoa from this checkout there (the C++ kernel only: no CUDA in
#    the build; it needs scikit-build-core, pybind11, CMake and a C++ compiler there).
#    Fetch the wheels where pip works, for the GPU machine's Python, e.g.:
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#        --implementation cp --platform manylinux2014_x86_64 -d .whl lark==1.3.1
# 2. Runs the GPU tests (tests/test_cuda.py, which fail here rather than skip) and
#    tests/test_load.py.
# 3. Measures host-to-device load throughput: aoa.load of a float32 checkpoint into CuPy
#    arrays, against cupy.asarray of the same tensors already in memory as numpy arrays
#    (safetensors.numpy.load_file, untimed), and against the pinned cudaMemcpy bandwidth;
#    then a bfloat16 checkpoint into float32 arrays (sent narrow, widened on the GPU).
#    Target: aoa >= 0.8x the pinned bandwidth.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=${AOA_SITE:-/tmp/aoa-gpu-site}
WHEELS=${AOA_WHEELS:-.whl}
SIZE_GB=${1:-4}
mkdir -p "$SITE"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
    "$WHEELS"/*.whl
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" -c "import cupy, lark, ml_dtypes, numpy, safetensors, tqdm" || {
  echo "gpu_check: a package above is missing; carry its wheel in $WHEELS" >&2; exit 1; }
echo "== building aoa into $SITE"
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --upgrade \
  --target "$SITE" .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "== GPU tests"
AOA_REQUIRE_CUDA=1 "$PYTHON" -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py \
  tests/test_load.py

echo "== host-to-device throughput (${SIZE_GB} GB)"
"$PYTHON" - "$SIZE_GB" <<'EOF'
import os
import sys
import tempfile
import time
from pathlib import Path

import cupy
import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

import aoa
from aoa.storage.safetensors import TensorSpec, write_safetensors

size = float(sys.argv[1]) * 1e9
hidden, inter, vocab = 4096, 11008, 32000
layer = [("q", (hidden, hidden)), ("k", (hidden, hidden)), ("v", (hidden, hidden)),
         ("o", (hidden, hidden)), ("gate", (inter, hidden)), ("up", (inter, hidden)),
         ("down", (hidden, inter)), ("norm", (hidden,))]
per_layer = sum(np.prod(s) for _, s in layer) * 4
layers = max(1, int((size - 2 * vocab * hidden * 4) // per_layer))
shapes = {"embed": (vocab, hidden), "lm_head": (vocab, hidden)}
shapes |= {f"layers.{i}.{n}": s for i in range(layers) for n, s in layer}
block = np.random.default_rng(0).standard_normal(1 << 24, dtype=np.float32)


def write(folder: Path, dtype: str) -> Path:
    def fill(views):
        for view in views.values():
            out = np.frombuffer(view, np.uint8)
            pattern = block.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else block
            raw = pattern.view(np.uint8)
            for start in range(0, out.size, raw.size):
                out[start:start + raw.size] = raw[:out.size - start]

    write_safetensors(folder / "model.safetensors",
                      [TensorSpec(k, dtype, s) for k, s in shapes.items()], None, fill)
    return folder / "model.safetensors"


def timed(run, repeats=3):
    run()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


# pinned cudaMemcpy bandwidth, one 1 GiB buffer
nbytes = 1 << 30
pinned = np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
pinned[:] = 1
device = cupy.empty(nbytes, cupy.uint8)
stream = cupy.cuda.Stream(non_blocking=True)
runtime = cupy.cuda.runtime


def memcpy():
    runtime.memcpyAsync(device.data.ptr, pinned.ctypes.data, nbytes,
                        runtime.memcpyHostToDevice, stream.ptr)
    stream.synchronize()


bandwidth = nbytes / timed(memcpy, 5) / 1e9
del device, pinned
threads = len(os.sched_getaffinity(0))
print(f"pinned cudaMemcpy: {bandwidth:.1f} GB/s; {layers} layers, {len(shapes)} tensors, "
      f"{threads} copy threads")

with tempfile.TemporaryDirectory(prefix="aoa-gpu-") as tmp:
    folder = Path(tmp)
    path = write(folder, "float32")
    total = path.stat().st_size
    into = {k: cupy.empty(s, cupy.float32) for k, s in shapes.items()}
    ours = timed(lambda: aoa.load([], source=folder, into=into, progress=False))
    host = load_file(path)
    for key, array in host.items():
        assert cupy.asnumpy(into[key]).tobytes() == array.tobytes(), key
    plain = timed(lambda: [cupy.asarray(a) for a in host.values()])
    del host
    rate, plain_rate = total / ours / 1e9, total / plain / 1e9
    print(f"float32 -> float32, {total / 1e9:.2f} GB: aoa.load {rate:.1f} GB/s "
          f"({rate / bandwidth:.2f}x pinned, target >= 0.8x; "
          f"{'met' if rate >= 0.8 * bandwidth else 'NOT met'}), "
          f"cupy.asarray of numpy arrays in memory {plain_rate:.1f} GB/s "
          f"(aoa {rate / plain_rate:.2f}x)")
    del into
    path.unlink()
    path = write(folder, "bfloat16")
    mapping = [f"{k} -> {k}, dtype='float32'" for k in shapes]
    into = {k: cupy.empty(s, cupy.float32) for k, s in shapes.items()}
    ours = timed(lambda: aoa.load(mapping, source=folder, into=into, progress=False))
    filled = sum(a.nbytes for a in into.values())
    host = load_file(path)
    for key, array in host.items():
        assert cupy.asnumpy(into[key]).tobytes() == array.astype(np.float32).tobytes(), key
    print(f"bfloat16 -> float32 (sent narrow, widened on the GPU): aoa.load "
          f"{filled / ours / 1e9:.1f} GB/s of float32 filled, {path.stat().st_size / ours / 1e9:.1f}"
          f" GB/s across the bus")
EOF
echo "gpu_check: done"
