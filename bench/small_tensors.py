"""Many small tensors: `aoa convert` of the 61-layer, 256-expert MoE of compile_scale.py
(31,540 source tensors in 63,018 shards, 125,486 destination shards, bfloat16, 192 MB) as a
checkpoint on disk, against its compile + plan time, side by side in one run.

The source is written as a TP2 ``dcp-safetensors`` checkpoint (two rank files with
DCP_SHARDING_INFO, random bytes); the destination is compile_scale.py's TP4 shard list,
given as ``--destination`` JSON. Each repeat times, one after another:

  compile   ``aoa.compile(statements, source shards, destination shards)`` in this process,
            ``--compiles`` times (default 3), the median kept: one compile of this model
            ranged 0.48-0.81 s between runs on these VMs, and a ratio over one sample
            moved with it as much as with the command
  convert   prepare + execute in this process (open the source, compile, plan, write, fsync)
  command   ``aoa convert`` as a user runs it: a fresh process, start to exit, with its
            peak RSS (VmHWM of its own image, as convert.py reads it: the rusage of a child
            spawned from this process counts this process's memory too, ~490-545 MB here
            where the command's own peak is ~380 MB)

and the goal is command <= 2x compile (no per-tensor work beyond planning); the convert
column is the same work without the process's start-up and exit. One round of
the three runs untimed first (``--warmup``): the VMs here page out what has been left alone
for a minute (DAMON's ``pageout`` scheme: regions idle for 12 x 5 s, up to 128 MB/s), the
source's pages and the interpreter's and aoa's own files too, and the first command after a
pause read them back (1.35 s against 1.10-1.14 s right after). The command
adds Python's start-up and imports: aoa's modules run from their compiled bytecode, as an
installed package's do (pip compiles it on install; this script compiles it first, since an
editable install under PYTHONDONTWRITEBYTECODE would compile 50-odd modules every run).

Usage: python bench/small_tensors.py [--layers 61] [--experts 256] [--repeats 3]
                                    [--compiles 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import compileall
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from compile_scale import build_model
from convert import CHILD

import aoa
from aoa.jobs.convert import execute, prepare
from aoa.layout import ShardDesc
from aoa.storage import open_source
from aoa.storage.safetensors import write_safetensors


def make_source(folder: Path, layout: dict[str, list[tuple]]) -> None:
    """One rank file per source shard position, random bytes, DCP_SHARDING_INFO."""
    folder.mkdir(parents=True, exist_ok=True)
    ranks = max(len(shards) for shards in layout.values())
    rng = np.random.default_rng(0)
    for rank in range(ranks):  # a tensor in one shard (a norm) is in rank 0's file
        shards = [ShardDesc(*found[rank]) for found in layout.values() if rank < len(found)]
        info = {s.key: {"saved_offsets": list(s.global_offset)} for s in shards}

        def fill(views: dict[str, memoryview]) -> None:
            for view in views.values():
                view[:] = rng.integers(0, 256, len(view), dtype=np.uint8).tobytes()

        write_safetensors(folder / f"rank-{rank:05d}-of-{ranks:05d}.safetensors", shards,
                          {"DCP_SHARDING_INFO": json.dumps(info), "DCP_VERSION": "1.0"}, fill)


def run_command(command: list[str]) -> tuple[float, int]:
    """Seconds from the command's start to its exit, and its peak RSS in bytes."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"the command failed ({done.returncode}): {done.stderr}")
    return seconds, int(done.stdout.split()[-1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compiles", type=int, default=3,
                        help="compiles per repeat, their median the yardstick")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--work", help="folder for the files (default: a temporary one)")
    args = parser.parse_args()
    if args.compiles < 1:
        parser.error("--compiles must be at least 1")
    work = Path(args.work or tempfile.mkdtemp(prefix="aoa-bench-small-"))
    model = build_model(args.layers, args.experts)
    source = work / f"src-{args.layers}x{args.experts}"
    if not source.exists():
        make_source(source, model.source)
    (work / "map.aoa").write_text("\n".join(model.statements) + "\n")
    (work / "destination.json").write_text(json.dumps(
        {key: [ShardDesc(*s).to_json() for s in shards]
         for key, shards in model.destination.items()}))
    source_shards = {k: [ShardDesc(*s) for s in v] for k, v in model.source.items()}
    destination_shards = {k: [ShardDesc(*s) for s in v] for k, v in model.destination.items()}
    statements = (work / "map.aoa").read_text()
    compileall.compile_dir(Path(aoa.__file__).parent, quiet=1)  # as pip does on install
    command = [sys.executable, "-c", CHILD, "convert", str(work / "map.aoa"), "--source",
               str(source), "--destination", str(work / "destination.json"), "--output",
               str(work / "out-command"), "--quiet"]
    rows = []
    nbytes = 0
    for repeat in range(-args.warmup, args.repeats):
        compiles = []
        for _ in range(args.compiles):
            start = time.perf_counter()
            aoa.compile(statements, source_shards, destination_shards)
            compiles.append(time.perf_counter() - start)
        compiled = statistics.median(compiles)
        shutil.rmtree(work / "out", ignore_errors=True)
        start = time.perf_counter()
        with open_source(source) as checkpoint:
            conversion = prepare(statements, checkpoint, destination=destination_shards)
            execute(conversion, work / "out")
        converted = time.perf_counter() - start
        nbytes = conversion.nbytes
        shutil.rmtree(work / "out-command", ignore_errors=True)
        commanded, peak = run_command(command)
        if repeat < 0:
            print(f"warm-up: command {commanded:.3f} s", file=sys.stderr)
            continue
        rows.append((compiled, min(compiles), max(compiles), converted, commanded, peak))
        print(f"repeat {repeat + 1}: compiles {' '.join(f'{c:.3f}' for c in compiles)} s, "
              f"convert {converted:.3f} s, command {commanded:.3f} s, "
              f"peak RSS {peak / 1e6:.0f} MB", file=sys.stderr)
    shards = sum(len(v) for v in model.destination.values())
    print(f"{args.layers}x{args.experts}: {len(model.source):,} source tensors, "
          f"{model.source_shards:,} source shards, {shards:,} destination shards, "
          f"{nbytes / 1e6:.0f} MB written")
    print(f"compile s: the median of {args.compiles} (their range beside it); each ratio is "
          "over that median")
    print(f"{'repeat':>6s}{'compile s':>11s}{'range':>14s}{'convert s':>11s}{'ratio':>7s}"
          f"{'command s':>11s}{'ratio':>7s}{'peak RSS MB':>13s}")
    for repeat, (compiled, low, high, converted, commanded, peak) in enumerate(rows, start=1):
        print(f"{repeat:6d}{compiled:11.3f}{f'{low:.3f}-{high:.3f}':>14s}{converted:11.3f}"
              f"{converted / compiled:7.2f}{commanded:11.3f}{commanded / compiled:7.2f}"
              f"{peak / 1e6:13.0f}")
    if len(rows) > 1:  # one slow sample of either side moves a repeat's ratio on these VMs
        ratios = sorted(commanded / compiled for compiled, _, _, _, commanded, _ in rows)
        print(f"command / compile: median {statistics.median(ratios):.2f} "
              f"({ratios[0]:.2f}-{ratios[-1]:.2f})")
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
