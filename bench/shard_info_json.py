"""Reading shard-info JSON (`--source`/`--destination` files): the 61-layer, 256-expert MoE's
TP4 destination of compile_scale.py (31,418 keys, 125,486 shards, 20 MB, written by
`json.dumps` as bench/small_tensors.py writes it), side by side in one run:

  parsed    ``json.loads`` then every description checked (`normalize_shard_info`): what
            `aoa.mapping.read_shard_info` did for every file, and still does for the rest
  regular   `aoa.shard_info_json.read_regular_shard_info`: the form `json.dumps` writes,
            read by splitting on its fixed text, each template parsed and checked once
  file      `aoa.mapping.read_shard_info` of the file, as the command reads it

Each time is the best of --repeats, the cyclic collector paused (as read_shard_info does).

With ``--command WORK`` (a bench/small_tensors.py work folder, its source made): also
``aoa convert`` as a process, wall and CPU seconds, alternately with WORK's destination.json
and with the same destination written with compact separators, which is read the old way.

Usage: python bench/shard_info_json.py [--layers 61] [--experts 256] [--repeats 5]
                                       [--command WORK]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from compile_scale import build_model

from aoa.inputs import load_json
from aoa.layout import ShardDesc, normalize_shard_info
from aoa.mapping import read_shard_info
from aoa.shard_info_json import read_regular_shard_info


def best(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.disable()
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
        del result
        gc.enable()
    return min(times)


def command(work: Path, destination: Path) -> tuple[float, float]:
    """Wall and CPU seconds of `aoa convert` of WORK's source to ``destination``."""
    out = work / "out-shard-info"
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "aoa.cli", "convert", str(work / "map.aoa"),
                    "--source", str(next(work.glob("src-*"))), "--destination",
                    str(destination), "--output", str(out), "--quiet"],
                   check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    shutil.rmtree(out)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def compare_commands(work: Path, repeats: int) -> None:
    regular = work / "destination.json"
    compact = work / "destination-compact.json"
    compact.write_text(json.dumps(json.loads(regular.read_text()), separators=(",", ":")))
    print(f"{'repeat':>6s}{'old way wall s':>16s}{'CPU s':>8s}{'regular wall s':>16s}"
          f"{'CPU s':>8s}")
    for repeat in range(1, repeats + 1):
        (old_wall, old_cpu), (wall, cpu) = command(work, compact), command(work, regular)
        print(f"{repeat:6d}{old_wall:16.3f}{old_cpu:8.3f}{wall:16.3f}{cpu:8.3f}", flush=True)
    compact.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--command", type=Path, metavar="WORK",
                        help="also time `aoa convert` of this small_tensors.py work folder")
    args = parser.parse_args()
    model = build_model(args.layers, args.experts)
    text = json.dumps({key: [ShardDesc(*s).to_json() for s in shards]
                       for key, shards in model.destination.items()})
    parsed = normalize_shard_info(load_json(text, "destination.json"), "destination")
    if read_regular_shard_info(text) != parsed:
        raise SystemExit("the regular form's reader and parsing disagree")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "destination.json"
        path.write_text(text)
        times = {
            "parsed": best(lambda: normalize_shard_info(load_json(text, str(path)),
                                                        "destination"), args.repeats),
            "regular": best(lambda: read_regular_shard_info(text), args.repeats),
            "file": best(lambda: read_shard_info(path, "destination"), args.repeats),
        }
    shards = sum(map(len, parsed.values()))
    print(f"{args.layers}x{args.experts}: {len(parsed):,} keys, {shards:,} shards, "
          f"{len(text) / 1e6:.1f} MB")
    print(f"{'parsed s':>9s}{'regular s':>11s}{'file s':>9s}{'parsed / regular':>18s}")
    print(f"{times['parsed']:9.3f}{times['regular']:11.3f}{times['file']:9.3f}"
          f"{times['parsed'] / times['regular']:18.2f}")
    if args.command:
        compare_commands(args.command, args.repeats)


if __name__ == "__main__":
    main()
