"""Start-up: `aoa --help` and `aoa check` of a small mapping, as processes, beside a bare
Python start (`python -c pass`) of the same interpreter.

The commands run in turn (bare, help, check JSON, check safetensors, bare, help, ...), so a
slow spell of a shared machine falls on all of them alike. Each run is timed as a process:
wall clock from start to exit, and the CPU time the child used (user + system, from
``os.wait4``), which a loaded machine inflates less than the wall clock. The table gives
the median and best of each and what each command costs on top of the bare start; the goal
(issue 13, goal 6) is at most 0.25 s on top.

    python bench/startup.py               # 15 runs of each
    python bench/startup.py --runs 30
    python bench/startup.py --instructions  # also instructions, one run each under callgrind

Wall time on a shared machine swings with its load; instruction counts (valgrind's
callgrind, ``--instructions``) do not, so the table can give those too: what each command
executes on top of the bare start.

The small mapping is two statements over a two-tensor model; its source is given once as
shard-info JSON and once as a safetensors file (read for its header), with a destination
shard-info JSON (tensor-parallel 2).

The commands run as an installed aoa runs for a user: with Python's bytecode cache, so
``PYTHONDONTWRITEBYTECODE`` is removed from their environment (where it is set, every
module is compiled from source at every start, which alone costs a few tenths of a second).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GOAL_SECONDS = 0.25
#: the children's environment: this one, with the bytecode cache allowed
ENVIRONMENT = {name: value for name, value in os.environ.items()
               if name != "PYTHONDONTWRITEBYTECODE"}

STATEMENTS = """\
model.embed_tokens.weight -> embed_tokens.weight
model.layers.$LAYER_ID.mlp.down_proj.weight^T -> layers.$LAYER_ID.mlp.down_proj.weight
"""
SHAPES = {"model.embed_tokens.weight": (32, 16), "model.layers.0.mlp.down_proj.weight": (16, 8),
          "model.layers.1.mlp.down_proj.weight": (16, 8)}


def whole(key: str, shape: tuple[int, ...]) -> dict:
    return {"key": key, "local_shape": list(shape), "global_shape": list(shape),
            "global_offset": [0] * len(shape), "dtype": "float32"}


def halves(key: str, shape: tuple[int, ...]) -> list[dict]:
    """Tensor-parallel 2 along the last axis."""
    half = shape[-1] // 2
    return [{"key": key, "local_shape": [*shape[:-1], half], "global_shape": list(shape),
             "global_offset": [0] * (len(shape) - 1) + [rank * half], "dtype": "float32"}
            for rank in range(2)]


def write_inputs(folder: Path) -> dict[str, Path]:
    """The mapping, its source (JSON and safetensors) and its destination, in ``folder``."""
    (folder / "mapping.aoa").write_text(STATEMENTS)
    (folder / "source.json").write_text(json.dumps(
        {key: [whole(key, shape)] for key, shape in SHAPES.items()}))
    destination = {"embed_tokens.weight": halves("embed_tokens.weight", (32, 16))}
    for layer in range(2):
        key = f"layers.{layer}.mlp.down_proj.weight"
        destination[key] = halves(key, (8, 16))
    (folder / "destination.json").write_text(json.dumps(destination))
    header, offset = {}, 0
    for key, shape in SHAPES.items():
        size = 4 * shape[0] * shape[1]
        header[key] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset,
                                                                              offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded
                                               + bytes(offset))
    return {name: folder / name for name in ("mapping.aoa", "source.json", "destination.json",
                                             "model.safetensors")}


def timed(command: list[str]) -> tuple[float, float]:
    """Wall seconds and child CPU seconds (user + system) of one run of ``command``."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=ENVIRONMENT)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.stderr is not None
    error = process.stderr.read()
    process.stderr.close()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited with {process.returncode}:\n"
                         f"{error.decode(errors='replace')}")
    return wall, usage.ru_utime + usage.ru_stime


def instructions(command: list[str]) -> int | None:
    """Instructions one run of ``command`` executes, counted by valgrind's callgrind (None
    where valgrind is missing)."""
    if shutil.which("valgrind") is None:
        return None
    result = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                             *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env=ENVIRONMENT, text=True, check=True)
    found = re.search(r"Collected : (\d+)", result.stderr)
    return int(found.group(1)) if found else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each command (default 15)")
    parser.add_argument("--instructions", action="store_true",
                        help="also count each command's instructions (valgrind, one run each)")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter that has aoa (default: this one)")
    args = parser.parse_args(argv)

    aoa = [args.python, "-m", "aoa.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        files = write_inputs(Path(tmp))
        check = [*aoa, "check", str(files["mapping.aoa"]), "--destination",
                 str(files["destination.json"]), "--source"]
        commands = {
            "python -c pass": [args.python, "-c", "pass"],
            "aoa --help": [*aoa, "--help"],
            "aoa check (JSON source)": [*check, str(files["source.json"])],
            "aoa check (safetensors)": [*check, str(files["model.safetensors"])],
        }
        for command in commands.values():  # warm the page cache and Lark's grammar cache
            timed(command)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, command in commands.items():
                runs[name].append(timed(command))
        counts = {name: instructions(command) if args.instructions else None
                  for name, command in commands.items()}

    bare = runs["python -c pass"]
    bare_wall = statistics.median(w for w, _ in bare)
    bare_cpu = statistics.median(c for _, c in bare)
    print(f"start-up as processes ({args.runs} runs each, interleaved; seconds)")
    header = (f"{'command':<26} {'wall median':>11} {'wall best':>10} {'cpu median':>11} "
              f"{'+wall':>7} {'+cpu':>7}  goal +{GOAL_SECONDS}")
    if args.instructions:
        header += "  instructions (+ on bare)"
    print(header)
    print("-" * len(header))
    bare_count = counts["python -c pass"]
    for name, times in runs.items():
        wall = statistics.median(w for w, _ in times)
        cpu = statistics.median(c for _, c in times)
        extra_wall, extra_cpu = wall - bare_wall, cpu - bare_cpu
        verdict = "" if times is bare else ("met" if extra_wall <= GOAL_SECONDS else "not met")
        line = (f"{name:<26} {wall:>11.3f} {min(w for w, _ in times):>10.3f} {cpu:>11.3f} "
                f"{extra_wall:>+7.3f} {extra_cpu:>+7.3f}  {verdict:<7}")
        count = counts[name]
        if count is not None and bare_count is not None:
            line += f"  {count / 1e6:8.1f} M (+{(count - bare_count) / 1e6:.1f} M)"
        print(line.rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
