"""Source formats side by side: the ~1.5 GB float32 Llama-like checkpoint of bench/convert.py,
saved as safetensors, as PyTorch DCP (by ``torch.distributed.checkpoint.save``), as a
Paddle FlexCheckpoint (by ``paddle.distributed.save_state_dict``) and as a
``pytorch_model.bin`` by ``torch.save``, zipped and in its legacy format (before PyTorch 1.6),
then in one run:

  convert   `aoa convert` with the demo's statements (fused QKV, fused gate/up, transposes,
            tensor-parallel 2) from each source, against safetensors;
  load      every tensor read into memory: aoa.load into numpy arrays against
            torch.distributed.checkpoint.load into preallocated torch tensors (DCP),
            ``torch.load`` (the .bin files: new tensors, as it makes them) and Paddle's
            load_state_dict into preallocated Paddle tensors (Paddle, timed inside its own
            process by bench/paddle_checkpoints.py time-load).

All files are in the page cache (each reader gets one untimed read first), so the figures
compare the readers, not the disk. Medians of ``--repeats`` runs.

Usage: .venv/bin/python bench/formats.py [--layers 8] [--repeats 3] [--threads N]
           [--work DIR] [--paddle-python /work/paddle-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import convert as convert_bench

from aoa import demo
from aoa.jobs.convert import execute, prepare
from aoa.jobs.load import load
from aoa.mesh_layout import read_mesh_layout
from aoa.storage.formats import open_source

HERE = Path(__file__).parent


def save_dcp(source: Path, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(load_file(str(source)), checkpoint_id=str(folder), no_dist=True)


def save_bin(source: Path, folder: Path, legacy: bool) -> None:
    import torch
    from safetensors.torch import load_file

    folder.mkdir(parents=True, exist_ok=True)
    torch.save(load_file(str(source)), folder / "pytorch_model.bin",
               _use_new_zipfile_serialization=not legacy)


def shapes_of(source: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with open_source(source) as checkpoint:
        return {key: (shards[0].global_shape, shards[0].dtype or "float32")
                for key, shards in checkpoint.shards.items()}


def convert_once(source: Path, output: Path, layout, threads: int | None) -> tuple[float, int]:
    shutil.rmtree(output, ignore_errors=True)
    with open_source(source) as checkpoint:
        conversion = prepare(convert_bench.mapping_text(), checkpoint, layout=layout)
        start = time.perf_counter()
        execute(conversion, output, threads=threads)
        return time.perf_counter() - start, conversion.nbytes


def aoa_load(source: Path, mapping: Path, shapes: dict, threads: int | None) -> float:
    arrays = {key: np.empty(shape, np.float32) for key, (shape, _) in shapes.items()}
    for array in arrays.values():
        array.fill(0)  # touched pages, as the frameworks' preallocated tensors are
    start = time.perf_counter()
    load(mapping, source, arrays, threads=threads, progress=False, distributed=False)
    return time.perf_counter() - start


def torch_load(source: Path, shapes: dict) -> float:
    import torch
    import torch.distributed.checkpoint as dcp

    state = {key: torch.zeros(shape) for key, (shape, _) in shapes.items()}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(source), no_dist=True)
    return time.perf_counter() - start


def torch_bin_load(folder: Path) -> float:
    """``torch.load`` of the folder's pytorch_model.bin (without ``mmap``, which the legacy
    format does not take: every tensor read into memory, as aoa.load reads them)."""
    import torch

    start = time.perf_counter()
    torch.load(folder / "pytorch_model.bin", weights_only=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--work", help="folder for the files (default: a temporary one)")
    parser.add_argument("--paddle-python", type=Path,
                        default=Path("/work/paddle-venv/bin/python"))
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="aoa-formats-"))
    sources = {"safetensors": work / "hf", "dcp": work / "dcp", "paddle": work / "paddle",
               "bin": work / "bin", "bin-legacy": work / "bin-legacy"}
    if not (sources["safetensors"] / "model.safetensors").exists():
        sources["safetensors"].mkdir(parents=True, exist_ok=True)
        convert_bench.make_source(sources["safetensors"], args.layers)
    safetensors_file = sources["safetensors"] / "model.safetensors"
    if not (sources["dcp"] / ".metadata").exists():
        save_dcp(safetensors_file, sources["dcp"])
    for name, legacy in (("bin", False), ("bin-legacy", True)):
        if not (sources[name] / "pytorch_model.bin").exists():
            save_bin(safetensors_file, sources[name], legacy)
    paddle = args.paddle_python.exists()
    if paddle and not (sources["paddle"] / "0.metadata").exists():
        subprocess.run([str(args.paddle_python), str(HERE / "paddle_checkpoints.py"),
                        "from-safetensors", str(safetensors_file), str(sources["paddle"])],
                       check=True, capture_output=True)
    if not paddle:
        del sources["paddle"]
    layout = read_mesh_layout(demo.data_file("llama_tp2.toml"))
    shapes = shapes_of(sources["safetensors"])
    identity = work / "identity.aoa"
    identity.write_text("# every tensor as it is\n")
    spec = work / "spec.json"
    spec.write_text(json.dumps({key: [list(shape), dtype] for key, (shape, dtype)
                                in shapes.items()}))
    nbytes_source = sum(np.prod(shape) * 4 for shape, _ in shapes.values())

    times: dict[str, list[float]] = {}
    nbytes = 0
    for repeat in range(args.repeats + 1):  # the first run warms the page cache, untimed
        run: dict[str, float] = {}
        for name, folder in sources.items():
            run[f"convert from {name}"], nbytes = convert_once(folder, work / "out", layout,
                                                               args.threads)
        for name in ("dcp", "paddle", "bin", "bin-legacy"):
            if name in sources:
                run[f"aoa.load {name}"] = aoa_load(sources[name], identity, shapes,
                                                   args.threads)
        run["dcp.load"] = torch_load(sources["dcp"], shapes)
        for name in ("bin", "bin-legacy"):
            run[f"torch.load {name}"] = torch_bin_load(sources[name])
        if repeat == 0:
            continue
        for key, seconds in run.items():
            times.setdefault(key, []).append(seconds)
        print(f"repeat {repeat}: " + ", ".join(f"{k} {v:.3f} s" for k, v in run.items()),
              file=sys.stderr)
    if paddle:
        printed = subprocess.run([str(args.paddle_python), str(HERE / "paddle_checkpoints.py"),
                                  "time-load", str(sources["paddle"]), str(spec)],
                                 check=True, capture_output=True, text=True).stdout
        times["paddle load_state_dict"] = [float(printed.split()[-1])]
    shutil.rmtree(work / "out", ignore_errors=True)
    median = {key: statistics.median(value) for key, value in times.items()}

    print(f"source: {nbytes_source / 1e9:.2f} GB ({args.layers} layers, float32); "
          f"converted: {nbytes / 1e9:.2f} GB in 2 tensor-parallel files")
    print(f"{'':26s}{'seconds':>9s}{'GB/s':>8s}")
    for key, seconds in median.items():
        moved = nbytes if key.startswith("convert") else nbytes_source
        print(f"{key:26s}{seconds:9.3f}{moved / seconds / 1e9:8.2f}")
    base = median["convert from safetensors"]
    for name in ("dcp", "paddle", "bin", "bin-legacy"):
        if name in sources:
            print(f"convert from {name} / from safetensors: "
                  f"{median[f'convert from {name}'] / base:.2f}")
    print(f"dcp.load / aoa.load of the DCP checkpoint: "
          f"{median['dcp.load'] / median['aoa.load dcp']:.2f}x")
    for name in ("bin", "bin-legacy"):
        print(f"torch.load / aoa.load of the {name} checkpoint: "
              f"{median[f'torch.load {name}'] / median[f'aoa.load {name}']:.2f}x")
    if paddle:
        print(f"Paddle load_state_dict / aoa.load of the Paddle checkpoint: "
              f"{median['paddle load_state_dict'] / median['aoa.load paddle']:.2f}x")
    if not args.work:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
